"""The carries and scanned inputs of the step loop and the segment scan
(`_loop.Integrator`), and the dense output at the inner save times."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from ._grid import Grid


class SegmentStats(NamedTuple):
    """Step counts of one segment (or, summed, of a solve)."""

    n_accepted: jax.Array
    n_rejected: jax.Array
    n_evals: jax.Array


def zero_stats():
    z = jnp.zeros((), jnp.int32)
    return SegmentStats(z, z, z)


def add_stats(a, b):
    return SegmentStats(*(x + y for x, y in zip(a, b, strict=True)))


class StepCarry(NamedTuple):
    """The carry of an adaptive segment's step loop."""

    t: jax.Array
    y: object
    fstate: object  # the solver state (first-same-as-last stage)
    dt: jax.Array  # the next step to try
    cstate: object  # the controller's state
    n_acc: jax.Array
    n_rej: jax.Array
    nfe: jax.Array
    code: jax.Array
    times: jax.Array  # accepted steps' end times (`record`), else empty
    acc: object  # the quadrature's accumulator, or None
    first: object  # the first accepted step's stages (`keep_first`), or None
    y_inner: object = None  # the states at the inner saves (`inner`), or None


class ScanCarry(NamedTuple):
    """The carry of the scan over segments."""

    y: object
    dt: jax.Array
    stats: SegmentStats
    code: jax.Array  # the first failure's code (0 while none)
    seg: jax.Array  # ... its segment
    t_fail: jax.Array  # ... and time
    f: object  # the last first-same-as-last state (`carries_fsal`), or None


def segment_xs(grid: Grid, bounds):
    """The scanned inputs of `Integrator.run`, one row per segment:
    `(a, b, input index, fixed steps, segment index, same inputs as before,
    inner save times or None)`."""
    # A boundary that is only a save time leaves the inputs as they were:
    # the vector field at the start of the next segment is the last
    # first-same-as-last stage of this one, so it is not evaluated again.
    same = np.zeros(grid.input_index.size, dtype=bool)
    same[1:] = grid.input_index[1:] == grid.input_index[:-1]
    return (
        bounds[:-1],
        bounds[1:],
        jnp.asarray(grid.input_index),
        jnp.asarray(grid.n_fixed),
        jnp.arange(grid.input_index.size, dtype=jnp.int32),
        jnp.asarray(same),
        None if grid.inner is None else jnp.asarray(grid.inner, bounds.dtype),
    )


def inner_like(inner, y):
    """Zeros for a segment's states at its inner save times `inner`."""
    return jtu.tree_map(lambda v: jnp.zeros((inner.shape[0], *v.shape), v.dtype), y)


def input_at(values, k):
    """Slice `k` of every input leaf (`None` without inputs)."""
    if values is None:
        return None
    return jtu.tree_map(lambda v: lax.dynamic_index_in_dim(v, k, 0, False), values)


def step_weights(solver, t0, t1, s, inside):
    """`h w_i(theta_k)` (`(K, stages)`, zero where not `inside`) of the saves
    at `s` (`(K,)` times) inside the step from `t0` to `t1`: the state there
    is `y0 + h sum_i w_i(theta_k) k_i` (`dense_weights`)."""
    h = t1 - t0
    theta = jnp.where(inside, (s - t0) / h, 0.0)
    return jnp.where(inside[:, None], h * solver.dense_weights(theta), 0.0)


def interpolate_inner(solver, c, accept, t1, ks, inner):
    """`c.y_inner` with the inner saves at `inner` (`(K,)` times) that the
    step from `c.t` to `t1` holds, if accepted, interpolated from its
    slopes `ks` (`step_weights`); behind a `cond`, so a step holding
    none costs one comparison."""
    inside = accept & (inner > c.t) & (inner <= t1)

    def fill(ops):
        y_inner, y0, ks = ops
        w = step_weights(solver, c.t, t1, inner, inside).astype(y0.dtype)
        column = (-1,) + (1,) * y0.ndim
        new = y0[None]
        for i, k in enumerate(ks):  # one fused kernel, no matrix product
            new = new + w[:, i].reshape(column) * k[None]
        return jnp.where(inside.reshape(column), new, y_inner)

    ops = (c.y_inner, c.y, ks)
    return lax.cond(jnp.any(inside), fill, lambda ops: ops[0], ops)
