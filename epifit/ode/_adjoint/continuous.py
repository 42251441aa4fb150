"""Continuous (optimize-then-discretize) adjoints.

All three integrate the adjoint ODE `dλ/dt = -(∂f/∂y)ᵀ λ` backwards over each
segment, in reverse time `τ = -t`, starting from the cotangent of the saved
states, and accumulate the parameter gradient `∫ λᵀ ∂f/∂θ dt`. They differ in
where the forward state `y(t)` comes from during the backward pass and how the
parameter integral is computed. Each restarts from the exact forward state at
every segment boundary (the solve keeps those anyway), which bounds the error
that backsolving accumulates.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .._errors import BUFFER_EXCEEDED, Result
from .._loop import Integrator
from .._misc import tree_all_finite
from .._solver import AbstractERK, AbstractImplicitSolver, AbstractSolver
from .._step_size import AbstractStepSizeController, ConstantStepSize, PIDController
from ._common import reverse_loop
from .base import AbstractAdjoint


def _hermite(s, h, y0, f0, y1, f1):
    """Cubic Hermite interpolation at `s` in [0, 1] of a step of length `h`."""
    h00 = (1 + 2 * s) * (1 - s) ** 2
    h10 = s * (1 - s) ** 2
    h01 = s**2 * (3 - 2 * s)
    h11 = s**2 * (s - 1)
    return h00 * y0 + h10 * h * f0 + h01 * y1 + h11 * h * f1


def _neg(tree):
    return jtu.tree_map(jnp.negative, tree)


def _nan_if(bad, tree):
    return jtu.tree_map(lambda x: jnp.where(bad, jnp.nan, x), tree)


def _with_buffer_check(code, n, buffer):
    """The backward segment's outcome, with a forward replay of more than
    `buffer` steps (which the dense output cannot hold) as a failure."""
    return jnp.where(n > buffer, BUFFER_EXCEEDED, code).astype(jnp.int32)


class _AbstractContinuousAdjoint(AbstractAdjoint):
    solver: AbstractSolver | None = None
    stepsize_controller: AbstractStepSizeController | None = None
    seminorm: bool = eqx.field(static=True, default=True)

    def loop(self, integrator, grid, y0, args, values, dt0):
        return reverse_loop(
            self, integrator, grid, y0, args, values, dt0, record=self._record
        )

    _record = True
    # A backward segment can fail (too many steps, a step too small, a
    # non-finite adjoint, a forward replay longer than `buffer`): the fourth
    # value `segment_backward` returns is `(code, t)`, and the failure is
    # raised as a `SolverError` when the solve has `throw=True` (see
    # `_common._reverse_scan`); with `throw=False` the gradient is NaN.
    backward_can_fail = True

    def _backward_integrator(self, ctx, vf_aug, norm_select):
        solver = ctx.integ.solver if self.solver is None else self.solver
        ctrl = (
            ctx.integ.controller
            if self.stepsize_controller is None
            else self.stepsize_controller
        )
        if isinstance(solver, AbstractImplicitSolver) and isinstance(
            ctrl, PIDController
        ):
            # an implicit backward solver's unset Newton tolerances, as in `solve`
            solver = solver.with_default_tolerances(ctrl.rtol, ctrl.atol)
        return Integrator(vf_aug, solver, ctrl, ctx.integ.max_steps, norm_select)

    def _integrate(self, ctx, k, a, b, integ_b, z_b, args_aug, quad=None):
        """Integrate the augmented state from t=b back to t=a (τ from -b to -a)."""
        n_fixed = jnp.asarray(ctx.grid.n_fixed)[k]
        if isinstance(integ_b.controller, ConstantStepSize):
            n_fixed = jnp.maximum(
                1,
                jnp.ceil((b - a) / integ_b.controller.dt0 - 1e-9).astype(jnp.int32),
            )
        out = integ_b.segment(
            -b, -a, z_b, args_aug, None, b - a, n_fixed, record=False, quad=quad
        )
        z_a, code, t_stop = out[0], out[3], -out[4]
        acc = out[6] if quad is not None else None
        return z_a, code, acc, t_stop


# ---------------------------------------------------------------------- backsolve
class BacksolveAdjoint(_AbstractContinuousAdjoint):
    """The continuous adjoint, solving the state backwards alongside the adjoint.

    Integrates `(y, λ, g)` backwards over each segment, with `y` restarted from
    the exact forward state at each segment end. `seminorm=True` leaves the
    parameter cotangent `g` out of the error norm (it never feeds back into the
    dynamics), which typically halves the backward steps.

    **Memory**: `O(n_segments * |y|)`; nothing per step. **Cost**: per backward
    step, one vector-field VJP per stage (about 3 forward evaluations). The
    gradient is that of the continuous problem, accurate to the tolerances,
    not the exact gradient of the computed solution. Unstable for problems whose
    reverse-time dynamics blow up (the segment restarts contain this).

    Args:
        solver: the backward solver (default: the forward one); a stiff solver
            such as `Kvaerno5()` may be chosen for stiff backward dynamics.
        stepsize_controller: the backward controller (default: the forward one).
        seminorm: leave the parameter cotangent out of the error norm.

    ??? cite "References"

        Chen, R. T. Q., Rubanova, Y., Bettencourt, J., Duvenaud, D. (2018). Neural
        ordinary differential equations. NeurIPS.

        Kidger, P., Chen, R. T. Q., Lyons, T. (2021). "Hey, that's not an ODE":
        faster ODE adjoints via seminorms. ICML.
    """

    _record = False

    def segment_backward(self, ctx, k, a, b, y_a, y_b, adj_y, a_p, u_l, up, times_k, n):
        def vf_aug(tau, z, args_aug, _):
            y, lam, _, _ = z
            ap, up_ = args_aug
            t = -tau
            f, vjp = jax.vjp(
                lambda y_, ap_, u_: ctx.vf(t, y_, ap_, u_, u_l), y, ap, up_
            )
            dlam, dap, dup = vjp(lam)
            return (_neg(f), dlam, dap, dup)

        sel = (lambda z: (z[0], z[1])) if self.seminorm else None
        integ_b = self._backward_integrator(ctx, vf_aug, sel)
        z_b = (
            y_b,
            adj_y,
            [jnp.zeros_like(x) for x in a_p],
            [jnp.zeros_like(x) for x in up],
        )
        z_a, code, _, t_stop = self._integrate(ctx, k, a, b, integ_b, z_b, (a_p, up))
        bad = code != Result.SUCCESSFUL
        _, lam, g_a, g_u = _nan_if(bad, z_a)
        return lam, g_a, g_u, (code, t_stop)


# ------------------------------------------------------------- dense forward state
class _Dense(eqx.Module):
    """Cubic Hermite interpolation of the forward state over a segment's steps."""

    ts: jax.Array  # (buffer + 1,), padded with the segment end
    ys: object  # state pytree, leading axis buffer + 1
    fs: object  # vector field at ts
    n: jax.Array

    def __call__(self, t):
        i = jnp.clip(jnp.searchsorted(self.ts, t, side="right") - 1, 0, self.n - 1)
        t0, t1 = self.ts[i], self.ts[i + 1]
        h = t1 - t0
        s = jnp.clip((t - t0) / jnp.where(h > 0, h, 1.0), 0.0, 1.0)

        def leaf(y, f):
            return _hermite(s, h, y[i], f[i], y[i + 1], f[i + 1])

        return jtu.tree_map(leaf, self.ys, self.fs)


def _dense_forward(ctx, buffer, a, y_a, a_p, u_l, up, times_k, n):
    """Replay the segment's accepted forward steps into a dense interpolant.

    At most `buffer` steps, and never more than the forward pass can take
    (`times_k` holds one time per step allowed by `max_steps`): a buffer
    larger than `max_steps` is cut to it, since the extra rows can never fill.
    """
    solver, vf = ctx.integ.solver, ctx.integ.vf
    buffer = min(buffer, times_k.shape[0])
    args, u = ctx.args(a_p), ctx.inputs(u_l, up)
    n = jnp.minimum(n, buffer)
    ts = jnp.concatenate([a[None], times_k[:buffer]])
    # Pad the unused tail with the segment end so searchsorted stays monotone.
    idx = jnp.arange(buffer + 1)
    ts = jnp.where(idx <= n, ts, ts[n])
    ys = jtu.tree_map(lambda x: jnp.zeros((buffer + 1, *x.shape), x.dtype), y_a)
    fs = jtu.tree_map(lambda x: jnp.zeros((buffer + 1, *x.shape), x.dtype), y_a)

    def body(i, st):
        y, ys, fs = st
        f = vf(ts[i], y, args, u)
        ys = jtu.tree_map(lambda b_, x: b_.at[i].set(x), ys, y)
        fs = jtu.tree_map(lambda b_, x: b_.at[i].set(x), fs, f)
        y1 = lax.cond(
            i < n,
            lambda y: solver.fresh_step(
                vf, ts[i], ts[jnp.minimum(i + 1, buffer)], y, args, u
            ),
            lambda y: y,
            y,
        )
        return y1, ys, fs

    _, ys, fs = lax.fori_loop(0, n + 1, body, (y_a, ys, fs))
    return _Dense(ts, ys, fs, n)


class InterpolatingAdjoint(_AbstractContinuousAdjoint):
    """The continuous adjoint with the forward state interpolated, not backsolved.

    For each segment (in reverse) the accepted forward steps are replayed from
    the segment's start state into a buffer and interpolated (cubic Hermite);
    `(λ, g)` is integrated backwards against that interpolant. More robust
    than backsolving when the reverse-time state dynamics are unstable.

    **Memory**: `O(n_segments * |y| + buffer * |y|)`. **Cost**: one forward
    replay per segment plus one vector-field VJP per backward stage. A segment
    with more than `buffer` accepted steps fails the backward pass (see
    [`epifit.ode.solve`][]'s `throw`): raise `buffer`.

    Args:
        solver, stepsize_controller, seminorm: as for
            [`epifit.ode.BacksolveAdjoint`][].
        buffer: the most forward steps per segment held for interpolation.

    ??? cite "Reference"

        Rackauckas, C. et al. (2020). Universal differential equations for
        scientific machine learning. arXiv:2001.04385 (InterpolatingAdjoint).
    """

    buffer: int = eqx.field(static=True, default=64)

    def segment_backward(self, ctx, k, a, b, y_a, y_b, adj_y, a_p, u_l, up, times_k, n):
        dense = _dense_forward(ctx, self.buffer, a, y_a, a_p, u_l, up, times_k, n)

        def vf_aug(tau, z, args_aug, _):
            lam = z[0]
            ap, up_ = args_aug
            t = -tau
            y = dense(t)
            _, vjp = jax.vjp(
                lambda y_, ap_, u_: ctx.vf(t, y_, ap_, u_, u_l), y, ap, up_
            )
            dlam, dap, dup = vjp(lam)
            return (dlam, dap, dup)

        sel = (lambda z: z[0]) if self.seminorm else None
        integ_b = self._backward_integrator(ctx, vf_aug, sel)
        z_b = (adj_y, [jnp.zeros_like(x) for x in a_p], [jnp.zeros_like(x) for x in up])
        z_a, code, _, t_stop = self._integrate(ctx, k, a, b, integ_b, z_b, (a_p, up))
        code = _with_buffer_check(code, n, self.buffer)
        lam, g_a, g_u = _nan_if(code != Result.SUCCESSFUL, z_a)
        return lam, g_a, g_u, (code, t_stop)


_GL_NODES = (0.5 - float(np.sqrt(15)) / 10, 0.5, 0.5 + float(np.sqrt(15)) / 10)
_GL_WEIGHTS = (5 / 18, 8 / 18, 5 / 18)


class QuadratureAdjoint(_AbstractContinuousAdjoint):
    """Adjoint state backwards; the parameter gradient by Gauss-Legendre quadrature.

    Only `λ` is integrated backwards (against the interpolated forward state, as
    in [`epifit.ode.InterpolatingAdjoint`][]), so the error control sees the
    adjoint alone. Over every accepted backward step the parameter gradient
    `∫ λᵀ ∂f/∂θ dt` is computed by 3-point Gauss-Legendre quadrature, with `λ`
    interpolated by a cubic Hermite polynomial on the step.

    **Memory**: as InterpolatingAdjoint. **Cost**: per backward step, the stage
    VJPs in `y` only, plus three VJPs in `θ` for the quadrature. Cheapest when
    the parameters are many and the vector field's parameter VJP is cheap. Needs
    an adaptive backward controller.

    Args:
        solver, stepsize_controller: as for [`epifit.ode.BacksolveAdjoint`][].
        buffer: the most forward steps per segment held for interpolation.

    ??? cite "Reference"

        Kim, S., Ji, W., Deng, S., Ma, Y., Rackauckas, C. (2021). Stiff neural
        ordinary differential equations. Chaos 31, 093122 (QuadratureAdjoint).
    """

    buffer: int = eqx.field(static=True, default=64)

    def segment_backward(self, ctx, k, a, b, y_a, y_b, adj_y, a_p, u_l, up, times_k, n):
        dense = _dense_forward(ctx, self.buffer, a, y_a, a_p, u_l, up, times_k, n)

        def vf_aug(tau, lam, args_aug, _):
            t = -tau
            y = dense(t)
            _, vjp = jax.vjp(lambda y_: ctx.vf(t, y_, a_p, up, u_l), y)
            (dlam,) = vjp(lam)
            return dlam

        integ_b = self._backward_integrator(ctx, vf_aug, None)
        if isinstance(integ_b.controller, ConstantStepSize):
            raise NotImplementedError(
                "QuadratureAdjoint needs an adaptive backward controller; pass "
                "stepsize_controller=PIDController(...) to it, or use "
                "InterpolatingAdjoint with fixed steps."
            )
        fsal = isinstance(integ_b.solver, AbstractERK) and integ_b.solver.tableau.fsal

        def quad_fn(acc, tau0, tau1, lam0, lam1, f0, f1):
            h = tau1 - tau0
            if not fsal:
                f0 = vf_aug(tau0, lam0, None, None)
                f1 = vf_aug(tau1, lam1, None, None)
            g_a, g_u = acc
            for s, w in zip(_GL_NODES, _GL_WEIGHTS, strict=True):
                lam = jtu.tree_map(
                    lambda l0, d0, l1, d1, s=s: _hermite(s, h, l0, d0, l1, d1),
                    lam0,
                    f0,
                    lam1,
                    f1,
                )
                t = -(tau0 + s * h)
                y = dense(t)
                _, vjp = jax.vjp(
                    lambda ap_, u_, t=t, y=y: ctx.vf(t, y, ap_, u_, u_l), a_p, up
                )
                dap, dup = vjp(lam)
                g_a = [g + (w * h) * d for g, d in zip(g_a, dap, strict=True)]
                g_u = [g + (w * h) * d for g, d in zip(g_u, dup, strict=True)]
            return g_a, g_u

        acc0 = ([jnp.zeros_like(x) for x in a_p], [jnp.zeros_like(x) for x in up])
        lam_a, code, (g_a, g_u), t_stop = self._integrate(
            ctx, k, a, b, integ_b, adj_y, None, quad=(quad_fn, acc0)
        )
        code = jnp.where(
            (code == Result.SUCCESSFUL) & ~tree_all_finite(lam_a),
            Result.NONFINITE_STATE,
            code,
        )
        code = _with_buffer_check(code, n, self.buffer)
        lam_a, g_a, g_u = _nan_if(code != Result.SUCCESSFUL, (lam_a, g_a, g_u))
        return lam_a, g_a, g_u, (code, t_stop)
