"""Scaffolding shared by the reverse-mode adjoints.

Every reverse adjoint wraps the segment scan in a `jax.custom_vjp` (with
`symbolic_zeros=True`, so it sees which leaves of `y0`, `args` and the input
values are differentiated) and walks the segments in reverse in its backward
pass. An adjoint supplies only `segment_backward`, the pull-back through one
segment.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.custom_derivatives import SymbolicZero

from .._errors import (
    Result,
    SolverError,
    format_backward_failure,
    raise_at_run_time,
)
from .._misc import tree_add, tree_all_finite, tree_all_zero

_FORWARD_MODE = contextvars.ContextVar("epifit_forward_mode", default=False)


@contextlib.contextmanager
def forward_mode():
    """Within this context every solve is forward-differentiable (no custom VJP)."""
    token = _FORWARD_MODE.set(True)
    try:
        yield
    finally:
        _FORWARD_MODE.reset(token)


def in_forward_mode() -> bool:
    return _FORWARD_MODE.get()


def materialize(x):
    """A symbolic zero cotangent as an array of zeros."""
    if isinstance(x, SymbolicZero):
        return jnp.zeros(x.shape, x.dtype)
    return x


def perturbed_index(leaves, flags):
    """Indices of perturbed (differentiated) floating leaves."""
    return [
        i
        for i, (x, p) in enumerate(zip(leaves, flags, strict=True))
        if p and jnp.issubdtype(jnp.result_type(x), jnp.inexact)
    ]


def merge(leaves, idx, sub):
    out = list(leaves)
    for i, s in zip(idx, sub, strict=True):
        out[i] = s
    return out


class SegmentContext:
    """What a segment's pull-back needs to rebuild the vector field's arguments."""

    def __init__(self, integ, grid, a_l, a_idx, a_def, v_idx, v_def, dtype):
        self.integ = integ
        self.grid = grid
        self.a_l = a_l
        self.a_idx = a_idx
        self.a_def = a_def
        self.v_idx = v_idx
        self.v_def = v_def
        self.dtype = dtype

    def args(self, ap):
        return jtu.tree_unflatten(self.a_def, merge(self.a_l, self.a_idx, ap))

    def inputs(self, u_l, up):
        if not u_l:
            return None
        return jtu.tree_unflatten(self.v_def, merge(u_l, self.v_idx, up))

    def vf(self, t, y, ap, up, u_l):
        """The vector field with the differentiated leaves substituted."""
        return self.integ.vf(t, y, self.args(ap), self.inputs(u_l, up))


def reverse_loop(
    adjoint, integ, grid, y0, args, values, dt0, record: bool, keep_first=False
):
    """Run the segment scan under a custom VJP defined by `adjoint.segment_backward`.

    `adjoint.segment_backward(ctx, k, a, b, y_a, y_b, adj_y, a_p, u_l, up,
    times_k, n_k)` returns `(adj_y_at_a, grad_a_p, grad_up)` for one segment.
    With `keep_first` (where `integ.can_keep_first`), `times_k` is
    `(times, stages)`, the stages of the segment's first accepted step
    (`Integrator.run`).
    """
    if in_forward_mode():
        ys, stats, fail, _, _ = integ.run(grid, y0, args, values, dt0, record=False)
        return ys, stats, fail
    y0_l, y0_def = jtu.tree_flatten(y0)
    a_l, a_def = jtu.tree_flatten(args)
    v_l, v_def = jtu.tree_flatten(values)
    box = {}

    def unflat(y_l, a_l_, v_l_):
        return (
            jtu.tree_unflatten(y0_def, y_l),
            jtu.tree_unflatten(a_def, a_l_),
            jtu.tree_unflatten(v_def, v_l_) if v_l_ else values,
        )

    @jax.custom_vjp
    def run(y_l, a_l_, v_l_):
        y, a, v = unflat(y_l, a_l_, v_l_)
        ys, stats, fail, _, _ = integ.run(grid, y, a, v, dt0, record=False)
        return ys, stats, fail

    def fwd(y_p, a_p, v_p):
        y_l_ = [p.value for p in y_p]
        a_l_ = [p.value for p in a_p]
        v_l_ = [p.value for p in v_p]
        box["a_idx"] = perturbed_index(a_l_, [p.perturbed for p in a_p])
        box["v_idx"] = perturbed_index(v_l_, [p.perturbed for p in v_p])
        box["y_pert"] = [p.perturbed for p in y_p]
        y, a, v = unflat(y_l_, a_l_, v_l_)
        ys, stats, fail, times, n_acc = integ.run(
            grid, y, a, v, dt0, record=record, keep_first=keep_first
        )
        return (ys, stats, fail), (a_l_, v_l_, ys, times, n_acc, fail[:2])

    def bwd(res, ct):
        a_l_, v_l_, ys, times, n_acc, fwd_fail = res
        a_idx, v_idx = box["a_idx"], box["v_idx"]
        ct_ys = jtu.tree_map(materialize, ct[0])
        dtype = jnp.result_type(*jtu.tree_leaves(ys))
        ctx = SegmentContext(integ, grid, a_l_, a_idx, a_def, v_idx, v_def, dtype)
        adj_y, adj_a, adj_v, fail = _reverse_scan(
            adjoint, ctx, ys, ct_ys, v_l_, times, n_acc, fwd_fail
        )
        if fail is not None and integ.throw:
            adj_y, adj_a, adj_v = _raise_if_backward_failed(
                (adj_y, adj_a, adj_v), adjoint, integ, grid, *fail
            )
        adj_y_l = [
            g if p else None
            for g, p in zip(jtu.tree_leaves(adj_y), box["y_pert"], strict=True)
        ]
        adj_a_l = [None] * len(a_l_)
        for i, g in zip(a_idx, adj_a, strict=True):
            adj_a_l[i] = g
        adj_v_l = [None] * len(v_l_)
        for i, g in zip(v_idx, adj_v, strict=True):
            adj_v_l[i] = g
        return adj_y_l, adj_a_l, adj_v_l

    run.defvjp(fwd, bwd, symbolic_zeros=True)
    return run(y0_l, a_l, v_l)


def _raise_if_backward_failed(x, adjoint, integ, grid, code, seg, t_stop):
    """`x`, after raising, at run time, the first failure of a backward pass
    (in the order the pass met them: the latest segment first) as a
    `SolverError`."""
    name = type(adjoint).__name__
    buffer = getattr(adjoint, "buffer", None)

    def check(code, seg, t_stop):
        code, seg = int(np.asarray(code)), int(np.asarray(seg))
        if code != Result.SUCCESSFUL:
            raise SolverError(
                format_backward_failure(
                    name,
                    code,
                    seg,
                    float(np.asarray(t_stop)),
                    float(grid.bounds[seg]),
                    float(grid.bounds[seg + 1]),
                    integ.max_steps,
                    buffer,
                )
            )

    failed = code != Result.SUCCESSFUL
    return raise_at_run_time(x, failed, check, code, seg, t_stop)


def _reverse_scan(adjoint, ctx, ys, ct_ys, v_l, times, n_acc, fwd_fail):
    """The backward scan over the segments. Returns `(adj_y0, adj_args,
    adj_values, fail)`, with `fail = (code, segment, t)` of the backward
    pass's first failure where the adjoint reports them
    (`adjoint.backward_can_fail`), else None.

    `fwd_fail = (code, segment)` is the forward pass's first failure. From
    that segment on the forward states are NaN fill, not functions of the
    segments before: those segments are not pulled back (no replay, no
    backward solve), and the cotangent goes on as NaN if any of it is
    non-zero (the loss used a failed state: its gradient is NaN, like the
    loss), else as zero (the loss used only states before the failure: its
    gradient is exact). Pulling the failed segment back would replay every
    step the forward pass took before it stopped (up to `max_steps`), in
    chunks of the adjoint's buffer, for nothing.

    Cost: one `adjoint.segment_backward` per live segment; memory: the
    cotangents of the state and of the differentiated leaves.
    """
    grid = ctx.grid
    bounds = jnp.asarray(grid.bounds, ctx.dtype)
    n_seg = grid.input_index.size
    a_p = [ctx.a_l[i] for i in ctx.a_idx]
    can_fail = adjoint.backward_can_fail
    ct_ys, ct_inner = _split_inner(ct_ys, grid, ctx.dtype)

    def body(carry, x):
        adj_y, adj_a, adj_v, fail = carry
        k, idx = x
        adj_y_in = adj_y
        y_a = jtu.tree_map(lambda v: v[k], ys)
        y_b = jtu.tree_map(lambda v: v[k + 1], ys)
        u_l = [lax.dynamic_index_in_dim(v, idx, 0, False) for v in v_l]
        up = [u_l[i] for i in ctx.v_idx]
        # At or after the forward pass's failure (see the docstring).
        dead = (fwd_fail[0] != Result.SUCCESSFUL) & (k >= fwd_fail[1])

        def pull_back():
            inner = None
            if ct_inner is not None:
                inner = (ct_inner[0][k], jtu.tree_map(lambda c: c[k], ct_inner[1]))
            return _pull_back_segment(
                adjoint,
                ctx,
                k,
                bounds[k],
                bounds[k + 1],
                y_a,
                y_b,
                adj_y,
                a_p,
                u_l,
                up,
                jtu.tree_map(lambda x: x[k], times),
                # Where a batch turns the `cond` below into a `select` (vmap),
                # the checkpoint adjoint still replays nothing: no steps.
                jnp.where(dead, 0, n_acc[k]),
                inner,
            )

        def skip():
            return _skip_segment(adj_y_in, a_p, up, can_fail, ctx.dtype)

        out = lax.cond(dead, skip, pull_back)
        adj_y, g_a, g_u = out[:3]
        if can_fail:
            fail = _first_failure(fail, out[3], adj_y_in, k)
        adj_a = [x + g.astype(x.dtype) for x, g in zip(adj_a, g_a, strict=True)]
        adj_v = [
            x.at[idx].add(g.astype(x.dtype)) for x, g in zip(adj_v, g_u, strict=True)
        ]
        adj_y = tree_add(adj_y, jtu.tree_map(lambda c: c[k], ct_ys))
        return (adj_y, adj_a, adj_v, fail), None

    zero = jnp.zeros((), jnp.int32)
    init = (
        jtu.tree_map(lambda c: c[n_seg], ct_ys),
        [jnp.zeros_like(x) for x in a_p],
        [jnp.zeros_like(v_l[i]) for i in ctx.v_idx],
        (zero, zero, jnp.zeros((), ctx.dtype)) if can_fail else None,
    )
    xs = (jnp.arange(n_seg, dtype=jnp.int32), jnp.asarray(grid.input_index))
    (adj_y, adj_a, adj_v, fail), _ = lax.scan(body, init, xs, reverse=True)
    return adj_y, adj_a, adj_v, fail


def _split_inner(ct_ys, grid, dtype):
    """`(cotangents at the boundaries, (inner save times, their cotangents)
    or None)`; the inner ones `(n_seg, K, ...)` (see `Grid.inner`)."""
    if grid.inner is None:
        return ct_ys, None
    n_b = grid.bounds.size
    shape = grid.inner.shape
    at_bounds = jtu.tree_map(lambda c: c[:n_b], ct_ys)
    inner = jtu.tree_map(lambda c: c[n_b:].reshape(*shape, *c.shape[1:]), ct_ys)
    return at_bounds, (jnp.asarray(grid.inner, dtype), inner)


def _pull_back_segment(
    adjoint, ctx, k, a, b, y_a, y_b, adj_y, a_p, u_l, up, t_k, n, inner=None
):
    """`adjoint.segment_backward` through segment `k`, its cotangents cast
    to the types of its inputs (those [`_skip_segment`][] builds), with
    `(code, t)` of its failure last where the adjoint can fail. `inner`:
    the segment's inner save times and their cotangents, where the grid has
    them (only for an adjoint that `differentiates_inner_saves`)."""
    extra = {} if inner is None else {"inner": inner}
    out = adjoint.segment_backward(
        ctx, k, a, b, y_a, y_b, adj_y, a_p, u_l, up, t_k, n, **extra
    )
    # Cast to the types `_skip_segment` builds from the inputs, so that the
    # segment backward is traced once (not also for its output shapes).
    adj, g_a, g_u = out[:3]
    adj = jtu.tree_map(lambda g, x: g.astype(x.dtype), adj, adj_y)
    g_a = [g.astype(x.dtype) for g, x in zip(g_a, a_p, strict=True)]
    g_u = [g.astype(x.dtype) for g, x in zip(g_u, up, strict=True)]
    if not adjoint.backward_can_fail:
        return adj, g_a, g_u
    code, t_stop = out[3]
    return adj, g_a, g_u, (code.astype(jnp.int32), t_stop.astype(ctx.dtype))


def _skip_segment(adj_y, a_p, up, can_fail, dtype):
    """What a segment at or after the forward failure passes back: the
    cotangent goes on as NaN if the loss used a failed state (a non-zero
    `adj_y`), else as zero; no backward failure is reported."""
    fill = jnp.where(tree_all_zero(adj_y), 0.0, jnp.nan)

    def like(x):
        return jnp.full(jnp.shape(x), fill, jnp.result_type(x))

    out = (
        jtu.tree_map(like, adj_y),
        [like(x) for x in a_p],
        [like(x) for x in up],
    )
    if not can_fail:
        return out
    return (*out, (jnp.zeros((), jnp.int32), jnp.zeros((), dtype)))


def _first_failure(fail, seg_fail, adj_y_in, k):
    """`fail = (code, segment, t)` of the backward pass's first failure,
    updated with segment `k`'s `seg_fail = (code, t)`."""
    code, t_stop = seg_fail
    # A cotangent that arrives non-finite (a NaN loss, say) is not the
    # backward pass's failure: its gradient is NaN, nothing is raised.
    code = jnp.where(tree_all_finite(adj_y_in), code, 0)
    first = (fail[0] == 0) & (code != 0)
    return (
        jnp.where(first, code, fail[0]),
        jnp.where(first, k, fail[1]),
        jnp.where(first, t_stop.astype(fail[2].dtype), fail[2]),
    )
