"""Discretize-then-optimize with segment checkpoints: the default adjoint."""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu

from .._carry import step_weights
from .._solver import AbstractERK
from ._common import reverse_loop
from .base import AbstractAdjoint


class CheckpointAdjoint(AbstractAdjoint):
    """The exact gradient of the discrete solution, from segment checkpoints.

    The forward pass keeps only the state at each segment boundary (which the
    solve returns anyway) and the times of the accepted steps. The backward pass
    walks the segments in reverse; for each it replays the accepted steps from
    the segment's start state, keeping at most `buffer` step states in memory,
    and back-propagates through them one step at a time (a VJP of one
    Runge-Kutta step: for explicit methods the discrete adjoint recursion over
    the stage states, recomputed from the step's start state). The accepted
    step sizes are treated as constants, as is standard for discrete
    adjoints: the result is the exact derivative of the computed solution on
    its mesh.

    **Memory**: `O(n_segments * |y|)` for the boundary states, plus
    `O(buffer * |y|)` in the backward pass, plus `O(n_segments * max_steps)`
    scalars for the step times. **Cost**: about one forward replay and one
    step-VJP (2-3 forward steps) per accepted step. A segment with more than
    `buffer` steps is processed in chunks, re-replaying from the segment start
    (quadratic in `steps / buffer`, rarely needed on daily segments).

    A segment of one step, the usual case on a daily grid, is pulled back
    with no replay loop and no buffer: with an explicit Runge-Kutta solver the
    step's stages are recomputed from the segment's start state (one forward
    step) and back-propagated, both unrolled at trace time (`unroll_first`).
    The steps of a longer segment are replayed (the stages in a run-time
    loop) to fill the buffer with the states before them, and each is pulled
    back by that same unrolled program, its operands materialised buffers as
    in the one-step branch, so XLA compiles its kernels once for both.
    With `keep_first` (adaptive explicit Runge-Kutta solvers) the forward pass
    keeps those stage states instead, at `O(n_segments * stages * |y|)`
    memory, which spares one forward step per segment but writes and re-reads
    that buffer; it is usually slower than recomputing, and gives the same
    gradient bit for bit (measurements: `epifit/ode/README.md`).

    Args:
        buffer: the number of step states held per chunk in the backward pass.
        keep_first: keep the first step's stage states of each segment from
            the forward pass (see above) instead of recomputing them.
        unroll_first: pull every step back with its stages unrolled at
            trace time (one copy of the vector field and of its VJP per
            stage) rather than in a run-time loop over a stage buffer
            (which then also keeps a replayed step's stage states, `stages`
            times the buffer's memory); faster, at some compile time (see
            `AbstractERK.step_vjp`).
        keep_values: with `unroll_first` (and not `keep_first`), the forward
            pass keeps the values the vector field notes in each segment's
            first step (`computed_once`'s coupling products, for an `epifit`
            model: one number per patch, stage and infection), and a
            replayed step keeps its own, so neither the pull-back's
            recomputed stages nor the parameters' pull-back compute them
            again (the first stage's, which the forward pass did not note,
            computed once): the reference gradient about 10% faster, bit
            for bit in float64. Nothing is kept for a vector field that
            notes nothing (a model without coupling).
    """

    buffer: int = eqx.field(static=True, default=16)
    keep_first: bool = eqx.field(static=True, default=False)
    unroll_first: bool = eqx.field(static=True, default=True)
    keep_values: bool = eqx.field(static=True, default=True)

    def __check_init__(self):
        if self.buffer < 1:
            raise ValueError(
                f"CheckpointAdjoint(buffer=...) must be >= 1; got {self.buffer}."
            )

    def loop(self, integrator, grid, y0, args, values, dt0):
        return reverse_loop(
            self,
            integrator,
            grid,
            y0,
            args,
            values,
            dt0,
            record=True,
            keep_first=self._keep_mode,
        )

    @property
    def differentiates_inner_saves(self) -> bool:
        """Interpolated saves are pulled back by the unrolled step program."""
        return self.unroll_first and not self.keep_first

    @property
    def _keep_mode(self):
        """What the forward pass keeps of each segment's first step: its stage
        states (`keep_first`), the values the vector field noted
        (`keep_values`, with the unrolled pull-back), or nothing."""
        if self.keep_first:
            return True
        if self.keep_values and self.unroll_first:
            return "values"
        return False

    def segment_backward(
        self, ctx, k, a, b, y_a, y_b, adj_y, a_p, u_l, up, times_k, n, inner=None
    ):
        """The pull-back through segment `k`'s `n` accepted steps (see the
        class docstring): one step's VJP without replay where `n == 1` and
        the solver is an explicit Runge-Kutta method, else the steps replayed and
        pulled back in chunks of the adjoint's buffer. `inner`: the times and
        cotangents of the segment's interpolated saves (with
        `differentiates_inner_saves`), each pulled back through the step
        that holds it."""
        solver = ctx.integ.solver
        if isinstance(times_k, tuple):  # the forward pass kept the first step
            times_k, stages0 = times_k
        else:
            stages0 = None
        values0 = None
        if self._keep_mode == "values":
            values0, stages0 = stages0, None
        erk = isinstance(solver, AbstractERK)
        if erk and self.unroll_first and stages0 is None:
            return _unrolled_segment_backward(
                ctx,
                a,
                y_a,
                adj_y,
                a_p,
                u_l,
                up,
                times_k,
                n,
                self.buffer,
                values0,
                inner,
            )
        if inner is not None:
            raise NotImplementedError("inner saves need the unrolled pull-back")
        fwd_step, pull_back = _step_and_pull_back(ctx, a, times_k, a_p, u_l, up, erk)
        B = self.buffer
        _, kept0 = jax.eval_shape(fwd_step, 0, y_a)
        n_chunks = (n + B - 1) // B

        def chunked(adj_y):
            return _pull_back_in_chunks(
                fwd_step, pull_back, kept0, y_a, adj_y, a_p, up, n, n_chunks, B
            )

        if not erk:
            return chunked(adj_y)

        def one_step(adj_y):
            # A segment of one step (the usual case on a daily grid) needs no
            # replay loop and no buffer: its stages were kept by the forward
            # pass, or are recomputed here from the segment's start state.
            dy, dap, dup = pull_back(
                0, stages0, adj_y, unroll=self.unroll_first, y0=y_a
            )
            return dy, list(dap), list(dup)

        return lax.cond(n == 1, one_step, chunked, adj_y)


def _unrolled_segment_backward(
    ctx, a, y_a, adj_y, a_p, u_l, up, times_k, n, buffer, values0=None, inner=None
):
    """The pull-back through a segment's `n` steps of an explicit Runge-Kutta
    method, each step by one unrolled program (`AbstractERK.step_vjp(...,
    unroll=True)`, its stages recomputed from the state before it).

    One step (the usual case) is pulled back from the segment's start state;
    several are replayed in chunks of `buffer` (`_pull_back_in_chunks`, the
    states before the steps kept) and pulled back one by one. Each call of
    the pull-back is a branch of a `cond` whose operands (the step's times,
    its start state, the cotangent) are whole buffers: its fused kernels are
    then the same in both places, and XLA CPU compiles identical kernels
    once; and no dynamic index into the step times is fused into them, which
    made the same kernels several times slower in a loop body (measurements:
    `epifit/ode/README.md`).

    `inner = (times, cotangents)` of the segment's interpolated saves: each
    step's pull-back takes those of the saves it holds (`_dense_cotangents`).
    """
    solver = ctx.integ.solver

    def f(t, y, th):
        return ctx.vf(t, y, th[0], th[1], u_l)

    def pull_step(ops):
        t0, t1, y0, adj, values = ops
        dense = None
        if inner is not None:
            dense = _dense_cotangents(solver, t0, t1, *inner)
        dy, (dap, dup) = solver.step_vjp(
            f, t0, t1, y0, (a_p, up), adj, unroll=True, values=values, dense=dense
        )
        return dy, list(dap), list(dup)

    def never(ops):  # the other branch of the conds below, for their sake
        return ops[3], [jnp.zeros_like(x) for x in a_p], [jnp.zeros_like(x) for x in up]

    t_of = functools.partial(_step_start, a, times_k)

    if values0 is None:

        def fwd_step(i, y):
            y1, _ = solver.loop_step(f, t_of(i), times_k[i], y, (a_p, up))
            return y1, (y, None)

    else:
        vf, args, u = ctx.integ.vf, ctx.args(a_p), ctx.inputs(u_l, up)

        def step_ops(ops):
            # the forward pass's own step (its kernels compiled once for both),
            # keeping the values its stages note for the pull-back
            t0, t1, y = ops
            return solver.fresh_step_with_values(vf, t0, t1, y, args, u)

        def no_step(ops):  # the cond's other branch: the shapes of `step_ops`
            return jtu.tree_map(jnp.zeros_like, (ops[2], values0))

        def fwd_step(i, y):
            ops = (t_of(i), times_k[i], y)
            y1, values = lax.cond(i >= 0, step_ops, no_step, ops)
            return y1, (y, values)

    def pull_back(i, kept, adj):
        y_i, values = kept
        ops = (t_of(i), times_k[i], y_i, adj, values)
        return lax.cond(i >= 0, pull_step, never, ops)

    def replayed(ops):
        n_chunks = (n + buffer - 1) // buffer
        kept0 = (y_a, values0)
        return _pull_back_in_chunks(
            fwd_step, pull_back, kept0, y_a, ops[3], a_p, up, n, n_chunks, buffer
        )

    ops = (a, times_k[0], y_a, adj_y, values0)
    return lax.cond(n == 1, pull_step, replayed, ops)


def _dense_cotangents(solver, t0, t1, s, w):
    """The cotangents `(of y0, of each stage's slope)` of the states
    interpolated inside the step from `t0` to `t1` at those of the save times
    `s` (`(K,)`, +inf where none) it holds, whose cotangents are `w`
    (`(K, ...)`): a save at `t0 < s_k <= t1` is `y0 + h sum_i w_i(theta_k)
    k_i` (`AbstractERK.dense_weights`)."""
    inside = (s > t0) & (s <= t1)
    weights = step_weights(solver, t0, t1, s, inside).astype(w.dtype)
    column = (-1,) + (1,) * (w.ndim - 1)
    # sums over the K saves, fused elementwise (no matrix products)
    direct = jnp.sum(inside.astype(w.dtype).reshape(column) * w, axis=0)
    slopes = [
        jnp.sum(weights[:, i].reshape(column) * w, axis=0)
        for i in range(weights.shape[1])
    ]
    return direct, slopes


def _step_start(a, times_k, i):
    """The start time of step `i` of a segment starting at `a` whose steps
    end at `times_k`."""
    return jnp.where(i == 0, a, times_k[jnp.maximum(i - 1, 0)])


def _step_and_pull_back(ctx, a, times_k, a_p, u_l, up, erk):
    """`(fwd_step, pull_back)` for the accepted steps of a segment starting at
    `a` with step end times `times_k`.

    `fwd_step(i, y)` is the state after step `i` and what its pull-back needs
    (`kept`): the stage states of a Runge-Kutta step (a run-time loop over the
    stages), else the state before it. `pull_back(i, kept, adj_y, unroll=False,
    y0=None)` is `(adj_y before step i, grad of a_p, grad of up)`.
    """
    solver = ctx.integ.solver

    def step(y, ap, up_, t0, t1):
        return solver.fresh_step(
            ctx.integ.vf, t0, t1, y, ctx.args(ap), ctx.inputs(u_l, up_)
        )

    t_of = functools.partial(_step_start, a, times_k)

    def f(t, y, th):
        return ctx.vf(t, y, th[0], th[1], u_l)

    def fwd_step(i, y):
        if erk:
            return solver.loop_step(f, t_of(i), times_k[i], y, (a_p, up))
        return step(y, a_p, up, t_of(i), times_k[i]), y

    def pull_back(i, kept, adj_y, unroll=False, y0=None):
        t0, t1 = t_of(i), times_k[i]
        if erk:
            dy, (dap, dup) = solver.step_vjp(
                f, t0, t1, y0, (a_p, up), adj_y, stage_states=kept, unroll=unroll
            )
            return dy, dap, dup
        _, vjp = jax.vjp(lambda y, ap, up_: step(y, ap, up_, t0, t1), kept, a_p, up)
        return vjp(adj_y)

    return fwd_step, pull_back


def _pull_back_in_chunks(
    fwd_step, pull_back, kept0, y_a, adj_y, a_p, up, n, n_chunks, buffer
):
    """The pull-back through `n` steps from `y_a`, the last chunk of `buffer`
    steps first: each chunk replays the steps from the segment start, keeps
    its own steps' `kept` (shaped like `kept0`) in a buffer, and pulls them
    back in reverse. Returns `(adj_y at the segment start, grad of a_p, grad
    of up)`. Cost: `n_chunks` replays of up to `n` steps, and `n` step VJPs;
    memory: `buffer` copies of `kept0`."""
    B = buffer

    def chunk(carry):
        c, adj_y, g_a, g_u = carry
        start = c * B
        m = jnp.minimum(B, n - start)
        buf = jtu.tree_map(lambda x: jnp.zeros((B, *x.shape), x.dtype), kept0)

        # One replay loop from the segment start; what this chunk's steps
        # need for their pull-backs is kept (one copy of the step compiled).
        def replay(i, st):
            y, buf = st
            y1, kept = fwd_step(i, y)
            j = jnp.clip(i - start, 0, B - 1)
            keep = i >= start
            buf = jtu.tree_map(
                lambda b_, x: lax.dynamic_update_index_in_dim(
                    b_,
                    jnp.where(keep, x, lax.dynamic_index_in_dim(b_, j, 0, False)),
                    j,
                    0,
                ),
                buf,
                kept,
            )
            return y1, buf

        _, buf = lax.fori_loop(0, start + m, replay, (y_a, buf))

        def back(jj, st):
            adj_y, g_a, g_u = st
            j = m - 1 - jj
            kept = jtu.tree_map(lambda b_: b_[j], buf)
            dy, dap, dup = pull_back(start + j, kept, adj_y)
            g_a = [g + d for g, d in zip(g_a, dap, strict=True)]
            g_u = [g + d for g, d in zip(g_u, dup, strict=True)]
            return dy, g_a, g_u

        adj_y, g_a, g_u = lax.fori_loop(0, m, back, (adj_y, g_a, g_u))
        return c - 1, adj_y, g_a, g_u

    zeros_ap = [jnp.zeros_like(x) for x in a_p]
    zeros_up = [jnp.zeros_like(x) for x in up]
    _, adj_y, g_a, g_u = lax.while_loop(
        lambda carry: carry[0] >= 0,
        chunk,
        (n_chunks - 1, adj_y, zeros_ap, zeros_up),
    )
    return adj_y, g_a, g_u
