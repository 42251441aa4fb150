"""Optimisation methods: one iteration each, with a common interface.

Every method works on the flat free vector `x` and carries `(x, f, g)`: the
point, its loss and its gradient. `step` proposes the next point and says
whether its loss or gradient was non-finite; the driver (`_optimize.py`) then
accepts it or retreats.

* [`FirstOrder`][]: any `optax.GradientTransformation` (Adam, RMSprop, SGD
  with momentum, with schedules, or one given as a phase); the step is scaled
  by the driver's retreat factor.
* [`LBFGS`][]: `optax.lbfgs()` with its zoom line search, given `value`,
  `grad` and `value_fn`. The line search backs off from non-finite values by
  itself; a failed step restarts the L-BFGS memory.
* [`LevenbergMarquardt`][]: damped Gauss-Newton on the residual vector, with
  the Jacobian from forward sensitivities ([`epifit.ode.jacobian`][]);
  `damping = 0` starts as pure Gauss-Newton.
"""

from __future__ import annotations

import abc
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from epifit.fitting._config import OPTAX, PhaseConfig

__all__ = [
    "AbstractLeastSquaresMethod",
    "AbstractMethod",
    "FirstOrder",
    "LBFGS",
    "LevenbergMarquardt",
    "StepInfo",
    "make_method",
]


class StepInfo(NamedTuple):
    nonfinite: jax.Array  # the proposed point's loss or gradient is not finite
    stuck: jax.Array  # the method cannot make progress from here (converged)


def _finite(f, g):
    return jnp.isfinite(f) & jnp.all(jnp.isfinite(g))


class AbstractMethod(eqx.Module):
    """One optimisation method. `fun` is the fit objective (with `loss`,
    `value_and_grad`, `residuals_and_jacobian`), `data` its traced data."""

    @abc.abstractmethod
    def init(self, x, f, g, fun, data) -> tuple[Any, Any, Any]:
        """`(state, f, g)` at the phase's starting point."""

    @abc.abstractmethod
    def step(self, x, f, g, state, scale, fun, data):
        """`(x, f, g, state, StepInfo)` after one iteration."""

    def on_nonfinite(self, old_state, new_state, x):
        """The state to continue from after a rejected (non-finite) step."""
        return old_state


class AbstractLeastSquaresMethod(AbstractMethod):
    """Marks methods for `loss = sum(r(x) ** 2)` that start from the residuals
    and their Jacobian (computed by the driver, shared with the Laplace
    approximation)."""

    @abc.abstractmethod
    def init_from_jacobian(self, x, r, J) -> tuple[Any, Any, Any]:
        """`(state, f, g)` from residuals `r` and Jacobian `J` at `x`."""

    def init(self, x, f, g, fun, data):
        r, J = fun.residuals_and_jacobian(x, data)
        return self.init_from_jacobian(x, r, J)


class FirstOrder(AbstractMethod):
    """An optax first-order transformation; `x <- x + scale * update`."""

    transform: optax.GradientTransformation = eqx.field(static=True)

    def init(self, x, f, g, fun, data):
        return self.transform.init(x), f, g

    def step(self, x, f, g, state, scale, fun, data, fresh=False):
        """One step; with `fresh` (the phase's first evaluation) no step is
        taken: the loss and gradient at `x` come back (one call site of the
        gradient in the compiled loop either way)."""
        u, new = self.transform.update(g, state, x)
        x_new = jnp.where(fresh, x, x + scale * u)
        state = jax.tree.map(lambda a, b: jnp.where(fresh, a, b), state, new)
        f_new, g_new = fun.value_and_grad(x_new, data)
        nonfinite = ~_finite(f_new, g_new)
        return x_new, f_new, g_new, state, StepInfo(nonfinite, jnp.asarray(False))


class LBFGS(AbstractMethod):
    """`optax.lbfgs` with a zoom line search."""

    memory_size: int = eqx.field(static=True, default=10)
    max_linesearch_steps: int = eqx.field(static=True, default=30)

    @property
    def transform(self) -> optax.GradientTransformationExtraArgs:
        return optax.lbfgs(
            memory_size=self.memory_size,
            linesearch=optax.scale_by_zoom_linesearch(
                max_linesearch_steps=self.max_linesearch_steps,
                initial_guess_strategy="one",
            ),
        )

    def init(self, x, f, g, fun, data):
        return self.transform.init(x), f, g

    def step(self, x, f, g, state, scale, fun, data):
        tx = self.transform
        u, new = tx.update(
            g, state, x, value=f, grad=g, value_fn=lambda y: fun.loss(y, data)
        )
        x_new = x + u
        f_new = optax.tree_utils.tree_get(new, "value")
        g_new = optax.tree_utils.tree_get(new, "grad")
        # A line search that found no decrease returns a zero step. If it met
        # only non-finite values (its decrease error is infinite) that is a
        # failed step to retreat from; otherwise the loss cannot decrease
        # along this direction: restart the memory (the next direction is the
        # scaled gradient) rather than repeat it.
        no_step = jnp.all(u == 0)
        info = optax.tree_utils.tree_get(new, "info")
        nonfinite = ~_finite(f_new, g_new) | (no_step & jnp.isinf(info.decrease_error))
        fresh = tx.init(x)
        new = jax.tree.map(lambda a, b: jnp.where(no_step, a, b), fresh, new)
        f_new = jnp.where(no_step, f, f_new)
        g_new = jnp.where(no_step, g, g_new)
        x_new = jnp.where(no_step, x, x_new)
        return x_new, f_new, g_new, new, StepInfo(nonfinite, jnp.asarray(False))

    def on_nonfinite(self, old_state, new_state, x):
        return self.transform.init(x)


class LMState(NamedTuple):
    r: jax.Array
    J: jax.Array
    damping: jax.Array


class LevenbergMarquardt(AbstractLeastSquaresMethod):
    """Levenberg-Marquardt on `loss = sum(r(x) ** 2)` with Marquardt's diagonal
    scaling: solve `(JᵀJ + λ diag(JᵀJ)) δ = -Jᵀr`; accept if the loss
    decreases (then `λ /= decrease`), else `λ *= increase`. With
    `damping = 0` it is Gauss-Newton until a step fails."""

    damping: float = eqx.field(static=True, default=1e-3)
    increase: float = eqx.field(static=True, default=10.0)
    decrease: float = eqx.field(static=True, default=10.0)
    min_damping: float = eqx.field(static=True, default=1e-6)
    max_damping: float = eqx.field(static=True, default=1e16)

    def init_from_jacobian(self, x, r, J):
        f = jnp.sum(jnp.square(r))
        g = 2.0 * J.T @ r
        return LMState(r, J, jnp.asarray(self.damping, x.dtype)), f, g

    def step(self, x, f, g, state, scale, fun, data):
        r, J, lam = state
        n = x.shape[0]
        d = jnp.sum(jnp.square(J), axis=0)
        d = jnp.maximum(d, 1e-12 * jnp.maximum(jnp.max(d), 1e-300))
        # least squares on [J; sqrt(λ D)] δ = [-r; 0]: better conditioned than
        # the normal equations, and fine when λ = 0 and J is rank deficient
        A = jnp.concatenate([J, jnp.diag(jnp.sqrt(lam * d))], axis=0)
        b = jnp.concatenate([-r, jnp.zeros((n,), r.dtype)])
        delta = jnp.linalg.lstsq(A, b)[0]
        x_c = x + scale * delta
        r_c, J_c = fun.residuals_and_jacobian(x_c, data)
        f_c = jnp.sum(jnp.square(r_c))
        finite = jnp.isfinite(f_c) & jnp.all(jnp.isfinite(J_c))
        accept = finite & (f_c < f)
        lam_new = jnp.where(
            accept,
            lam / self.decrease,
            jnp.maximum(lam * self.increase, self.min_damping),
        )
        lam_new = jnp.where(lam_new < self.min_damping * 1e-6, 0.0, lam_new)
        x_new = jnp.where(accept, x_c, x)
        r_new = jnp.where(accept, r_c, r)
        J_new = jnp.where(accept, J_c, J)
        f_new = jnp.where(accept, f_c, f)
        g_new = 2.0 * J_new.T @ r_new
        stuck = lam_new >= self.max_damping
        state = LMState(r_new, J_new, lam_new)
        # a rejected candidate leaves a finite (x, f, g); report non-finite
        # candidates so that persistent failures stop the fit
        return x_new, f_new, g_new, state, StepInfo(~finite, stuck)

    def on_nonfinite(self, old_state, new_state, x):
        return new_state  # keeps the larger damping


def _schedule(phase: PhaseConfig):
    lr = phase.option("learning_rate", 1e-2)
    kind = phase.option("schedule", "constant")
    n = phase.iterations
    final = phase.option("final_fraction", 0.01)
    if kind == "constant":
        return lr
    if kind == "cosine":
        return optax.cosine_decay_schedule(lr, decay_steps=n, alpha=final)
    if kind == "exponential":
        return optax.exponential_decay(
            lr,
            transition_steps=phase.option("transition_steps", max(1, n // 10)),
            decay_rate=phase.option("decay_rate", 0.5),
        )
    return optax.warmup_cosine_decay_schedule(
        0.0,
        lr,
        warmup_steps=phase.option("warmup_steps"),
        decay_steps=n,
        end_value=lr * final,
    )


def make_method(phase: PhaseConfig) -> AbstractMethod:
    """The method of one phase of a fit configuration."""
    m = phase.method
    if m == OPTAX:
        return FirstOrder(phase.option("transform"))
    if m in ("adam", "rmsprop", "sgd"):
        lr = _schedule(phase)
        if m == "adam":
            tx = optax.adam(
                lr,
                b1=phase.option("b1", 0.9),
                b2=phase.option("b2", 0.999),
                eps=phase.option("eps", 1e-8),
            )
        elif m == "rmsprop":
            tx = optax.rmsprop(
                lr,
                decay=phase.option("decay", 0.9),
                eps=phase.option("eps", 1e-8),
                momentum=phase.option("momentum"),
                centered=phase.option("centered", False),
            )
        else:
            tx = optax.sgd(
                lr,
                momentum=phase.option("momentum"),
                nesterov=phase.option("nesterov", False),
            )
        if (clip := phase.option("clip")) is not None:
            tx = optax.chain(optax.clip_by_global_norm(clip), tx)
        return FirstOrder(tx)
    if m == "lbfgs":
        return LBFGS(
            memory_size=phase.option("memory_size", 10),
            max_linesearch_steps=phase.option("max_linesearch_steps", 30),
        )
    if m == "gauss_newton":
        return LevenbergMarquardt(damping=0.0)
    return LevenbergMarquardt(damping=phase.option("damping", 1e-3))
