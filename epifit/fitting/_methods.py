"""Optimisation methods: one iteration each, with a common interface.

Every method works on the flat free vector `x` and carries `(x, f, g)`: the
point, its loss and its gradient. `step` is one trip of the driver's loop
(`_optimize.py`) and evaluates the objective once, so a compiled chunk holds
one copy of `value_and_grad` (or of the residual Jacobian); its `StepInfo`
says whether the new point's loss or gradient was non-finite (the driver then
retreats), whether the method is stuck and whether the trip counts as an
iteration.

* [`FirstOrder`][]: any `optax.GradientTransformation` (Adam, RMSprop, SGD
  with momentum, with schedules, or one given as a phase); the step is scaled
  by the driver's retreat factor.
* [`LBFGS`][]: L-BFGS with its line search as a state machine: each trip
  evaluates one trial point `x + t d`, accepted on the Armijo condition,
  else `t` shrinks (quadratic interpolation; halved after a non-finite
  value); the first direction is scaled as optax scales it. Backtracking
  trials are not iterations. It replaces `optax.lbfgs` with its zoom line
  search, which evaluates `value_and_grad` at two sites (its first trial and
  its zoom loop), so its chunk held two copies of the gradient.
* [`LevenbergMarquardt`][]: damped Gauss-Newton on the residual vector, with
  the Jacobian from forward sensitivities ([`epifit.ode.jacobian`][]);
  `damping = 0` starts as pure Gauss-Newton.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar, NamedTuple

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
    "TrialMethod",
    "make_method",
]


class StepInfo(NamedTuple):
    nonfinite: jax.Array  # the proposed point's loss or gradient is not finite
    stuck: jax.Array  # the method cannot make progress from here (converged)
    # the trip is an iteration (counted towards the budgets and the patience):
    # L-BFGS's backtracking trials are not
    counted: jax.Array | bool = True


def _finite(f, g):
    return jnp.isfinite(f) & jnp.all(jnp.isfinite(g))


class AbstractMethod(eqx.Module):
    """One optimisation method. `fun` is the fit objective (with `loss`,
    `value_and_grad`, `residuals_and_jacobian`), `data` its traced data.

    A method with `evaluates_start` takes `step(..., fresh=...)`: with
    `fresh`, the phase's first trip evaluates the starting point itself (so
    a first phase needs no program of its own for it). Such a method is a
    [`TrialMethod`][]: its step is a trial point, one evaluation there, and
    the update from it, so that the driver can run several such phases in one
    compiled program with one evaluation site."""

    evaluates_start: ClassVar[bool] = False

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


class TrialMethod(AbstractMethod):
    """A method whose trip is a trial point, one `value_and_grad` there, and
    the update from it: `step` is `propose`, the evaluation, `accept`. The
    driver runs every phase of such methods in one compiled program
    (`lax.switch` over the phases' `propose` and `accept`, the evaluation
    between them shared)."""

    evaluates_start: ClassVar[bool] = True

    @abc.abstractmethod
    def propose(self, x, f, g, state, scale, fresh) -> tuple[Any, Any]:
        """`(x_t, state)`: the trial point (`x` itself when `fresh`) and the
        state to pass to `accept`."""

    @abc.abstractmethod
    def accept(self, x, f, g, state, scale, fresh, x_t, f_t, g_t):
        """`(x, f, g, state, StepInfo)` after the trial `(x_t, f_t, g_t)`."""

    def step(self, x, f, g, state, scale, fun, data, fresh=False):
        x_t, state = self.propose(x, f, g, state, scale, fresh)
        f_t, g_t = fun.value_and_grad(x_t, data)
        return self.accept(x, f, g, state, scale, fresh, x_t, f_t, g_t)


class FirstOrder(TrialMethod):
    """An optax first-order transformation; `x <- x + scale * update`. With
    `fresh` (the phase's first evaluation) no step is taken: the loss and
    gradient at `x` come back (one call site of the gradient in the compiled
    loop either way)."""

    transform: optax.GradientTransformation = eqx.field(static=True)

    def init(self, x, f, g, fun, data):
        return self.transform.init(x), f, g

    def propose(self, x, f, g, state, scale, fresh):
        u, new = self.transform.update(g, state, x)
        x_new = jnp.where(fresh, x, x + scale * u)
        state = jax.tree.map(lambda a, b: jnp.where(fresh, a, b), state, new)
        return x_new, state

    def accept(self, x, f, g, state, scale, fresh, x_t, f_t, g_t):
        nonfinite = ~_finite(f_t, g_t)
        info = StepInfo(nonfinite, jnp.asarray(False), jnp.asarray(True))
        return x_t, f_t, g_t, state, info


class LBFGSState(NamedTuple):
    """L-BFGS between loop trips: the memory (circular, the newest pair at
    `(count - 1) % memory_size`; empty slots have `rho = 0`), the search
    direction from the current point and the step of the next trial."""

    s: jax.Array  # (memory, n) accepted steps x_{k+1} - x_k
    y: jax.Array  # (memory, n) their gradient changes g_{k+1} - g_k
    rho: jax.Array  # (memory,) 1 / (s . y); 0 in an empty slot
    count: jax.Array  # pairs stored since the last restart
    gamma: jax.Array  # s . y / y . y of the newest pair: the initial scale
    d: jax.Array  # (n,) the search direction from x
    t: jax.Array  # the step of the next trial point x + t d
    rejected: jax.Array  # trials rejected in a row along d


class LBFGS(TrialMethod):
    """L-BFGS as a step function: one evaluation of `value_and_grad` per loop
    trip, at the trial point `x + t d`.

    The direction `d = -H g` comes from the two-loop recursion over the last
    `memory_size` pairs `(s, y)` with the initial scale `gamma = s.y / y.y`
    of the newest pair; with an empty memory it is the gradient scaled as
    optax scales its first step, `d = -g min(1, 1 / |g|_2)`. A trial is
    accepted when its loss and gradient are finite and it decreases the loss
    enough (Armijo, `c1 = 1e-4`); the pair enters the memory only when its
    curvature `s.y` is positive (relative to `|s| |y|`), and the next trial is
    `t = 1` along the new direction. A rejected finite trial shrinks `t` to
    the minimiser of the quadratic through `f`, `g.d` and the trial's loss,
    clipped to `[0.1 t, 0.5 t]`; a non-finite one halves it and is reported
    to the driver as non-finite (a retreat). After `max_linesearch_steps`
    rejections in a row the memory restarts (the next direction is the scaled
    gradient); if the memory was already empty, the method is stuck.

    A trip counts as an iteration when it is accepted or non-finite
    (`StepInfo.counted`): backtracking trials are part of an iteration, as in
    a line search, and do not use up the iteration budget or the patience.
    """

    memory_size: int = eqx.field(static=True, default=10)
    max_linesearch_steps: int = eqx.field(static=True, default=30)
    c1: float = eqx.field(static=True, default=1e-4)

    def _direction(self, g, s, y, rho, count, gamma):
        """`-H g` by the two-loop recursion (newest pair first)."""
        m = self.memory_size
        order = (count - 1 - jnp.arange(m)) % m
        scale = jnp.where(count > 0, gamma, _first_scale(g))

        def newest_first(q, i):
            a = rho[i] * jnp.dot(s[i], q)
            return q - a * y[i], a

        q, alpha = jax.lax.scan(newest_first, g, order)

        def oldest_first(r, ia):
            i, a = ia
            b = rho[i] * jnp.dot(y[i], r)
            return r + (a - b) * s[i], None

        r, _ = jax.lax.scan(oldest_first, scale * q, (order[::-1], alpha[::-1]))
        return -r

    def init(self, x, f, g, fun, data):
        n, m = x.shape[0], self.memory_size
        zeros = jnp.zeros((m, n), x.dtype)
        one = jnp.ones((), x.dtype)
        zero = jnp.zeros((), jnp.int32)
        state = LBFGSState(
            zeros,
            zeros,
            jnp.zeros((m,), x.dtype),
            zero,
            one,
            -_first_scale(g) * g,
            one,
            zero,
        )
        return state, f, g

    def _trial_step(self, state, fresh):
        return jnp.where(fresh, jnp.zeros_like(state.t), state.t)

    def propose(self, x, f, g, state, scale, fresh):
        """The trial `x + t d`; with `fresh` (the phase's first evaluation)
        the trial is `x` itself, accepted when finite, and the first
        direction is set."""
        return x + self._trial_step(state, jnp.asarray(fresh)) * state.d, state

    def accept(self, x, f, g, state, scale, fresh, x_t, f_t, g_t):
        st, fresh = state, jnp.asarray(fresh)
        t = self._trial_step(st, fresh)
        finite = _finite(f_t, g_t)
        gd = jnp.dot(g, st.d)
        accept = finite & (fresh | (f_t <= f + self.c1 * t * gd))

        # the pair enters the memory if its curvature is positive
        s, y = x_t - x, g_t - g
        sy, yy = jnp.dot(s, y), jnp.dot(y, y)
        tiny = jnp.finfo(x.dtype).eps * jnp.sqrt(jnp.dot(s, s) * yy)
        store = accept & ~fresh & (sy > tiny)
        i = st.count % self.memory_size
        put = lambda mem, v: jnp.where(store, mem.at[i].set(v), mem)  # noqa: E731
        S, Y = put(st.s, s), put(st.y, y)
        rho = put(st.rho, 1.0 / jnp.where(store, sy, 1.0))
        count = jnp.where(store, st.count + 1, st.count)
        gamma = jnp.where(store, sy / jnp.where(store, yy, 1.0), st.gamma)

        # a rejected trial: a shorter step along d; too many: restart or stuck
        denominator = 2.0 * (f_t - f - gd * t)
        quadratic = -gd * t * t / denominator
        quadratic = jnp.where(denominator > 0, quadratic, 0.5 * t)
        shorter = jnp.where(finite, jnp.clip(quadratic, 0.1 * t, 0.5 * t), 0.5 * t)
        exhausted = ~accept & (st.rejected + 1 >= self.max_linesearch_steps)
        restart = exhausted & (st.count > 0)
        stuck = exhausted & (st.count == 0)
        rho = jnp.where(restart, jnp.zeros_like(rho), rho)
        count = jnp.where(restart, 0, count)

        # the next direction, at the new point (accepted) or the old (restart)
        g_dir = jnp.where(accept, g_t, g)
        d = self._direction(g_dir, S, Y, rho, count, gamma)
        descent = (jnp.dot(g_dir, d) < 0) & jnp.all(jnp.isfinite(d))
        rho = jnp.where(descent, rho, jnp.zeros_like(rho))
        count = jnp.where(descent, count, 0)
        d = jnp.where(descent, d, -_first_scale(g_dir) * g_dir)

        new_dir = accept | restart
        state = LBFGSState(
            S,
            Y,
            jnp.where(new_dir, rho, st.rho),
            jnp.where(new_dir, count, st.count).astype(jnp.int32),
            gamma,
            jnp.where(new_dir, d, st.d),
            jnp.where(new_dir, jnp.ones_like(t), jnp.where(stuck, st.t, shorter)),
            jnp.where(new_dir, 0, st.rejected + 1).astype(jnp.int32),
        )
        x_new = jnp.where(accept, x_t, x)
        f_new = jnp.where(accept, f_t, f)
        g_new = jnp.where(accept, g_t, g)
        info = StepInfo(~finite, stuck, accept | ~finite)
        return x_new, f_new, g_new, state, info

    def on_nonfinite(self, old_state, new_state, x):
        return new_state  # the halved step along the same direction


def _first_scale(g):
    """optax's scale of the first L-BFGS step: `min(1, 1 / |g|_2)`."""
    return jnp.minimum(1.0, 1.0 / jnp.sqrt(jnp.dot(g, g))).astype(g.dtype)


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
        return x_new, f_new, g_new, state, StepInfo(~finite, stuck, jnp.asarray(True))

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
