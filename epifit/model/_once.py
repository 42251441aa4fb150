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
    infection read by two compartments (S loses what E gains) then computes
    its coupling product (a gather and a reduction) twice per evaluation.
    Wrapping it in a one-trip `while_loop` whose trip count XLA cannot see
    (it depends on the run-time time `t`) makes it a buffer of its own, at
    the cost of one while-loop per evaluation. Other backends get
    `fn(*operands)`. (Measurements: `epifit/model/README.md`.)

    Differentiable: the JVP is `jax.jvp(fn)`, with no loop (a loop in the
    primal of a linearisation would run again in every backward step), so
    forward and reverse mode work; only an undifferentiated evaluation goes
    through the loop. A NaN `t` gives a NaN result (the loop then runs no trip).

    The value is noted for the ODE core (`epifit.ode`'s checkpoint adjoint
    keeps it from the forward pass). Where the ODE core hands a kept value
    back (`kept_value`), `fn` is not evaluated: the kept value is the
    result, and a linearisation computes only the tangent of `fn` (so a
    pull-back with respect to the parameters alone, whose operands here
    carry no tangent, computes nothing of it).
    """
    given = kept_value()
    if given is not None:  # the forward pass's value, handed back
        out = _given(fn, given, operands)
    else:
        out = _once(fn, jnp.asarray(t), operands)
    note_value(out)
    return out


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _given(fn, value, operands):
    # `value` is `fn(*operands)`, computed by the forward pass: its tangent is
    # that of `fn` (which also holds where the backward pass is differentiated
    # again, as in forward-over-reverse Hessians)
    return value


@_given.defjvp
def _given_jvp(fn, primals, tangents):
    value, operands = primals
    _, d_operands = tangents
    _, tangent = jax.jvp(fn, operands, d_operands)
    return value, tangent


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
    return jax.jvp(fn, operands, d_operands)
