"""Sums over leading axes as additions, for XLA CPU.

XLA CPU emits a reduction that keeps an array's last axis (`x.sum(axis=0)`
of a `(stages, rows, patch)` array, say) as a loop over the kept elements
with a scalar inner loop over the reduced ones: it is not vectorised along
the last axis. The same sum written as additions of slices is an
elementwise kernel, vectorised along it. Autodiff writes such reductions
where it transposes a broadcast: the parameters' pull-back of a step
(`_erk._theta_vjp`), batched over the stages, reduces every per-patch
rate's cotangent over the stages and the rows it scales. There the
additions made that pull-back three times faster (15.5 against 4.9 us a
step) and the reference gradient 10% faster (measurements:
`epifit/ode/README.md`).

[`sums_as_additions`][] evaluates a function's program with those
reductions replaced; everything else is bound as traced, so it composes
with `jit`, `vmap` and forward- and reverse-mode differentiation around it.
"""

from __future__ import annotations

import math

import jax
import jax.lax as lax
import jax.tree_util as jtu
from jax.extend import core as jex_core

__all__ = ["sums_as_additions", "sum_by_additions"]

# The most elements a sum may add up by additions; a longer one stays a
# reduction (a fused kernel reading hundreds of slices compiles slowly).
MAX_ADDED = 64


def sums_as_additions(fun):
    """`fun`, with every sum (`reduce_sum`) in its program that keeps the
    last axis and adds up 2 to `MAX_ADDED` elements per result computed by
    [`sum_by_additions`][]. Same values up to rounding (the order of the
    additions differs). `fun` takes and returns pytrees of arrays; its
    program is traced at each call (trace time only)."""

    def wrapped(*args):
        closed, shapes = jax.make_jaxpr(fun, return_shape=True)(*args)
        outs = _evaluate(closed.jaxpr, closed.consts, jtu.tree_leaves(args))
        return jtu.tree_unflatten(jtu.tree_structure(shapes), outs)

    return wrapped


def sum_by_additions(x, axes):
    """`x.sum(axes)` as additions of the slices along each axis in `axes`,
    the last axis excepted. An axis longer than `MAX_ADDED` is first halved
    (its two halves added) until it is not, so that no fused kernel reads
    too many slices."""
    axes = sorted({a % x.ndim for a in axes}, reverse=True)
    if x.ndim - 1 in axes:
        raise ValueError("sum_by_additions keeps the last axis")
    for a in axes:
        parts = []  # the odd slices left over by the halvings
        while x.shape[a] > MAX_ADDED:
            n, half = x.shape[a], x.shape[a] // 2
            if n % 2:
                parts.append(lax.index_in_dim(x, n - 1, a, keepdims=False))
            x = lax.slice_in_dim(x, 0, half, axis=a) + lax.slice_in_dim(
                x, half, 2 * half, axis=a
            )
        parts = [
            lax.index_in_dim(x, i, a, keepdims=False) for i in range(x.shape[a])
        ] + parts
        x = parts[0]
        for part in parts[1:]:
            x = x + part
    return x


# Calls of a nested `jit`, evaluated inline (as XLA inlines them).
_INLINED = ("jit", "pjit")


def _by_additions(x, axes) -> bool:
    if not axes or x.ndim - 1 in axes:
        return False
    return 2 <= math.prod(x.shape[a] for a in axes) <= MAX_ADDED


def _evaluate(jaxpr, consts, args):
    """`jax.core.eval_jaxpr`, with the sums `_by_additions` selects replaced,
    in nested `jit` calls too."""
    env = {}

    def read(v):
        return v.val if isinstance(v, jex_core.Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        if eqn.primitive is lax.reduce_sum_p and _by_additions(
            invals[0], eqn.params["axes"]
        ):
            outs = [sum_by_additions(invals[0], eqn.params["axes"])]
        elif eqn.primitive.name in _INLINED:  # a nested `jit`: its sums too
            inner = eqn.params["jaxpr"]
            outs = _evaluate(inner.jaxpr, inner.consts, invals)
        else:
            params = eqn.primitive.get_bind_params(eqn.params)
            if isinstance(params, tuple):  # older JAX: (sub-functions, params)
                subfuns, params = params
                invals = [*subfuns, *invals]
            with eqn.ctx.manager:
                out = eqn.primitive.bind(*invals, **params)
            outs = out if eqn.primitive.multiple_results else [out]
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]
