"""Step-size controllers."""

from __future__ import annotations

import abc

import equinox as eqx
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu

from ._misc import rms_norm


class AbstractStepSizeController(eqx.Module):
    """Chooses the steps within a segment."""


class ConstantStepSize(AbstractStepSizeController):
    """Fixed steps of (at most) `dt0`.

    Each segment `[a, b]` is cut into `ceil((b - a) / dt0)` equal steps, so every
    segment boundary is hit exactly.
    """

    dt0: float = eqx.field(static=True)

    def __check_init__(self):
        if not self.dt0 > 0:
            raise ValueError(
                f"ConstantStepSize(dt0=...) needs dt0 > 0; got {self.dt0}."
            )


class AbstractAdaptiveStepSizeController(AbstractStepSizeController):
    @abc.abstractmethod
    def init(self, dtype): ...

    @abc.abstractmethod
    def adapt(self, y0, y1, y_error, dt, error_order, state):
        """Returns `(accept, dt_next, state_next_if_accepted)`."""


class PIDController(AbstractAdaptiveStepSizeController):
    """A proportional-integral-derivative step-size controller.

    The local error is measured in the scaled RMS norm
    `sqrt(mean((err / (atol + rtol * max(|y0|, |y1|)))**2))` over every element
    of the state pytree; a step is accepted when that is at most 1. The next step
    is `dt * safety * r_n**(-b1) * r_{n-1}**(-b2) * r_{n-2}**(-b3)` clipped to
    `[factormin, factormax] * dt`, with `b1 = (p + i + d) / k`,
    `b2 = -(p + 2 d) / k`, `b3 = d / k` and `k` the solver's error order. The
    defaults (`pcoeff=0, icoeff=1, dcoeff=0`) are the classical integral
    controller.

    Args:
        rtol, atol: relative and absolute tolerances.
        pcoeff, icoeff, dcoeff: PID coefficients.
        safety: safety factor on the proposed step.
        factormin, factormax: limits on the step-size ratio.
        dtmin: the smallest step allowed; a smaller one is a failure.
        dtmax: the largest step allowed (`None`: the segment length).

    ??? cite "Reference"

        Söderlind, G. (2003). Digital filters in adaptive time-stepping. ACM
        Transactions on Mathematical Software, 29(1), 1-26.
    """

    rtol: float = eqx.field(static=True, default=1e-3)
    atol: float = eqx.field(static=True, default=1e-6)
    pcoeff: float = eqx.field(static=True, default=0.0)
    icoeff: float = eqx.field(static=True, default=1.0)
    dcoeff: float = eqx.field(static=True, default=0.0)
    safety: float = eqx.field(static=True, default=0.9)
    factormin: float = eqx.field(static=True, default=0.2)
    factormax: float = eqx.field(static=True, default=10.0)
    dtmin: float = eqx.field(static=True, default=0.0)
    dtmax: float | None = eqx.field(static=True, default=None)

    def __check_init__(self):
        if not (self.rtol >= 0 and self.atol >= 0 and self.rtol + self.atol > 0):
            raise ValueError(
                f"PIDController needs rtol >= 0, atol >= 0 and one of them > 0; got "
                f"rtol={self.rtol}, atol={self.atol}."
            )
        if not 0 < self.safety <= 1:
            raise ValueError(
                f"PIDController(safety=...) must be in (0, 1]; got {self.safety}."
            )
        if not 0 < self.factormin < 1 < self.factormax:
            raise ValueError(
                "PIDController needs 0 < factormin < 1 < factormax; got "
                f"factormin={self.factormin}, factormax={self.factormax}."
            )
        if self.dtmin < 0 or (self.dtmax is not None and self.dtmax <= self.dtmin):
            raise ValueError(
                f"PIDController needs 0 <= dtmin < dtmax; got dtmin={self.dtmin}, "
                f"dtmax={self.dtmax}."
            )

    def init(self, dtype):
        one = jnp.ones((), dtype)
        return (one, one)  # inverse scaled errors of the two previous accepted steps

    def error_ratio(self, y0, y1, y_error):
        def scaled(e, a, b):
            tol = self.atol + self.rtol * jnp.maximum(jnp.abs(a), jnp.abs(b))
            return e / tol

        return rms_norm(jtu.tree_map(scaled, y_error, y0, y1))

    def adapt(self, y0, y1, y_error, dt, error_order, state):
        ratio = self.error_ratio(y0, y1, y_error)
        finite = jnp.isfinite(ratio)
        accept = finite & (ratio <= 1.0)
        k = float(error_order)
        b1 = (self.pcoeff + self.icoeff + self.dcoeff) / k
        b2 = -(self.pcoeff + 2 * self.dcoeff) / k
        b3 = self.dcoeff / k
        inv = 1.0 / jnp.maximum(jnp.where(finite, ratio, jnp.inf), 1e-10)
        inv_prev, inv_prev2 = state
        factor = self.safety * inv**b1
        if b2 != 0.0:
            factor = factor * inv_prev**b2
        if b3 != 0.0:
            factor = factor * inv_prev2**b3
        factor = jnp.where(finite, factor, self.factormin)
        # After a rejection never grow the step.
        factor = jnp.where(accept, factor, jnp.minimum(factor, 1.0))
        factor = jnp.clip(factor, self.factormin, self.factormax)
        dt_next = dt * factor
        if self.dtmax is not None:
            dt_next = jnp.minimum(dt_next, self.dtmax)
        inv = inv.astype(inv_prev.dtype)
        new_state = (inv, inv_prev)
        return accept, dt_next, new_state


def first_step(ctrl, vf, a, b, y, args, u, dt, fstate, from_fsal):
    """The first step of an adaptive segment `[a, b]`, and the vector-field
    evaluations it cost: `dt` itself where `dt > 0`, else (the first segment
    without `dt0`) `0.01 * ||y|| / ||f(y)||` in `ctrl`'s scaled norm (the first
    half of Hairer's heuristic), capped at `b - a`. `f(y)` is the solver's
    first-same-as-last state `fstate` where `from_fsal` (no evaluation), else
    one evaluation. The controller grows the step by up to `factormax` per
    accepted step.
    """
    first = dt <= 0
    # Only the first segment needs (and, without a first-same-as-last
    # state, counts) the evaluation of f(y).
    extra = 0 if from_fsal else 1

    def scaled(x):
        return rms_norm(
            jtu.tree_map(
                lambda xi, yi: xi / (ctrl.atol + ctrl.rtol * jnp.abs(yi)), x, y
            )
        )

    def guess():
        f0 = fstate if from_fsal else vf(a, y, args, u)
        d0, d1 = scaled(y), scaled(f0)
        h0 = jnp.where((d0 < 1e-5) | (d1 < 1e-5), 1e-6, 0.01 * d0 / d1)
        h0 = jnp.where(jnp.isfinite(h0), h0, b - a).astype(a.dtype)
        return jnp.minimum(h0, b - a)

    # A `cond`, not a `where`: the two norms over the state are needed by
    # the first segment only, and a `where` would compute them in every
    # segment.
    dt_first = lax.cond(first, guess, lambda: jnp.asarray(dt, a.dtype))
    return dt_first, jnp.where(first, extra, 0).astype(jnp.int32)
