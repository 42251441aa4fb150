"""Evaluate a sub-expression of the vector field once per call, on XLA CPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from epifit.ode import kept_value, note_value


def computed_once(fn, t, *operands):
    """`fn(*operands)`, computed once into its own buffer on the CPU backend.

    XLA CPU fuses a producer into every consumer that reads it, and a fused
    loop recomputes the producer for each element it writes. A force of
    infection read by two compartments (S loses what E gains) is then
    computed twice per evaluation, coupling gather and reduction included.
    Wrapping it in a one-trip `while_loop` whose trip count XLA cannot see
    (it depends on the run-time time `t`) makes it a buffer of its own, at
    the cost of one while-loop per evaluation. Other backends get
    `fn(*operands)`. (Measurements: `epifit/model/README.md`.)

    Differentiable: the JVP is `jax.jvp(fn)`, with no loop (a loop in the
    primal of a linearisation would run again in every backward step), so
    forward and reverse mode work; only an undifferentiated evaluation goes
    through the loop. A NaN `t` gives a NaN result (the loop then runs no trip).

    The value is noted for the ODE core (`epifit.ode`'s checkpoint adjoint
    keeps it from the forward pass), and a linearisation takes a kept value
    as its primal where one is handed back, so the pull-back's recomputed
    stages compute only its tangent.
    """
    out = _once(fn, jnp.asarray(t), operands)
    note_value(out)
    return out


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _once(fn, t, operands):
    if jax.default_backend() != "cpu":
        return fn(*operands)
    shape = jax.eval_shape(fn, *operands)
    start = jnp.where(jnp.isnan(t), 1, 0).astype(jnp.int32)
    init = (start, jax.tree.map(lambda s: jnp.full(s.shape, jnp.nan, s.dtype), shape))
    return jax.lax.while_loop(
        lambda c: c[0] < 1, lambda c: (c[0] + 1, fn(*operands)), init
    )[1]


@_once.defjvp
def _once_jvp(fn, primals, tangents):
    _, operands = primals
    _, d_operands = tangents
    value, tangent = jax.jvp(fn, operands, d_operands)
    given = kept_value()
    if given is not None:  # the forward pass's value: `value` is then unused
        value = jax.tree.map(lambda g, v: g.astype(v.dtype), given, value)
    return value, tangent
