"""Explicit Runge-Kutta methods with stages unrolled at trace time."""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import jax.numpy as jnp
import jax.tree_util as jtu

from .base import AbstractAdaptiveSolver, AbstractSolver


class ButcherTableau(NamedTuple):
    """A Butcher tableau.

    `a[i]` holds the coefficients of stage `i + 1` (stage 0 is the vector field at
    the start of the step). `b_error` is `b - b_embedded` (`None` without an
    embedded method). `fsal` marks methods whose last stage is evaluated at the
    new state, so it is reused as the first stage of the next step.
    """

    c: tuple[float, ...]
    a: tuple[tuple[float, ...], ...]
    b: tuple[float, ...]
    b_error: tuple[float, ...] | None = None
    fsal: bool = False

    @property
    def n_stages(self) -> int:
        return len(self.b)


def _combine(y0, dt, coeffs, ks):
    """`y0 + dt * sum_j coeffs[j] * ks[j]` per leaf; zero coefficients skipped.

    The coefficients are Python floats, so the sum is unrolled at trace time and
    XLA fuses it into one elementwise kernel per leaf.
    """
    pairs = [(float(c), k) for c, k in zip(coeffs, ks, strict=False) if c != 0.0]
    if not pairs:
        return y0
    cs = [c for c, _ in pairs]

    def leaf(y, *kl):
        acc = kl[0] * cs[0]
        for c, k in zip(cs[1:], kl[1:], strict=True):
            acc = acc + k * c
        step = acc * dt.astype(acc.dtype)
        return step if y is None else y + step.astype(y.dtype)

    if y0 is None:
        return jtu.tree_map(lambda *kl: leaf(None, *kl), *[k for _, k in pairs])
    return jtu.tree_map(leaf, y0, *[k for _, k in pairs])


class AbstractERK(AbstractSolver):
    """An explicit Runge-Kutta method given by its tableau."""

    tableau: ClassVar[ButcherTableau]

    def init(self, vf, t0, y0, args, u):
        if self.tableau.fsal:
            return vf(t0, y0, args, u), 1
        return None, 0

    def step(self, vf, t0, t1, y0, args, u, state):
        tab = self.tableau
        dt = jnp.asarray(t1 - t0)
        if tab.fsal:
            k0 = state
            n_evals = tab.n_stages - 1
        else:
            k0 = vf(t0, y0, args, u)
            n_evals = tab.n_stages
        ks = [k0]
        y1 = None
        for i, (ci, ai) in enumerate(zip(tab.c, tab.a, strict=True)):
            yi = _combine(y0, dt, ai, ks)
            if tab.fsal and i == len(tab.a) - 1:
                y1 = yi
                ti = t1
            else:
                ti = t0 + ci * dt
            ks.append(vf(ti, yi, args, u))
        if y1 is None:
            y1 = _combine(y0, dt, tab.b, ks)
        if tab.b_error is None:
            y_error = None
        else:
            y_error = _combine(None, dt, tab.b_error, ks)
        new_state = ks[-1] if tab.fsal else None
        return y1, y_error, new_state, n_evals


class AbstractAdaptiveERK(AbstractERK, AbstractAdaptiveSolver):
    """An explicit Runge-Kutta pair with an embedded error estimate."""
