"""Values a vector field computes once per evaluation, kept by the forward
pass for the backward pass's recomputed stages.

A vector field may mark a sub-expression it computes once per evaluation
(`epifit.model`'s `computed_once`: a coupling product) by calling
[`note_value`][] with its value, and ask [`kept_value`][] first for a value
to use instead of computing it. The explicit Runge-Kutta step records the
noted values of its stages (`recording`) where the checkpoint adjoint asks
for them, and the one-step pull-back hands them back (`injecting`) to the
stages it recomputes and to the parameters' batched pull-back, so neither
computes them again (measurements: `epifit/ode/README.md`).
Both contexts act at trace time only. `solve` evaluates its vector field
through [`traced_once`][], which traces it once per signature and passes
these values as the traced call's operands and outputs.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax

_RECORD: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "epifit_ode_record", default=None
)
_INJECT: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "epifit_ode_inject", default=None
)


def note_value(value) -> None:
    """Offer `value`, a sub-expression of the vector field computed once per
    evaluation (a pytree of arrays), to be kept by the forward pass of
    `CheckpointAdjoint(keep_values=True)`; elsewhere it does nothing.

    The same sub-expression asks [`kept_value`][] first and, given a value,
    uses it instead of computing its own (its linearisation then computes
    only the tangent). Call it in the same order in every evaluation.
    """
    out = _RECORD.get()
    if out is not None:
        out.append(value)


def kept_value():
    """The value the forward pass kept for the next noted sub-expression
    (see [`note_value`][]) while the backward pass linearises a stage or
    pulls the parameters back, else None (then compute it)."""
    queue = _INJECT.get()
    if queue:
        return queue.pop(0)
    return None


@contextlib.contextmanager
def recording():
    """Collect the values noted within, in order, into the list yielded."""
    out: list = []
    token = _RECORD.set(out)
    try:
        yield out
    finally:
        _RECORD.reset(token)


@contextlib.contextmanager
def injecting(values):
    """Hand `values` (a list, in the order they were noted) to
    [`kept_value`][], one a call."""
    token = _INJECT.set(list(values))
    try:
        yield
    finally:
        _INJECT.reset(token)


def traced_once(vf):
    """`vf(t, y, args, u)` behind a `jax.jit`, so that it is traced once per
    signature however many times a solve's program evaluates it (the stages
    of a step, the forward pass and the backward pass's recomputed stages,
    their linearisations and batched pull-backs): tracing a model's vector
    field is the largest part of tracing its gradient. XLA inlines the call,
    so the compiled program is the same.

    The values [`note_value`][] and [`kept_value`][] pass at trace time
    become the call's outputs and operands: the values an enclosing
    [`injecting`][] holds are handed to this evaluation (all of them: the
    ODE core hands each evaluation its own), and the values the evaluation
    notes are noted again outside, where [`recording`][] collects them.
    """

    def evaluate(t, y, args, u, given, record):
        with injecting(given), recording() as noted:
            dy = vf(t, y, args, u)
        return dy, (noted if record else [])

    # a function of its own for each vector field: JAX's caches hold it
    # weakly, so a solve's traces go when its vector field does
    call = jax.jit(evaluate, static_argnums=(5,))

    def traced(t, y, args, u):
        queue = _INJECT.get() or []
        given, queue[:] = list(queue), []  # all of them, taken
        record = _RECORD.get() is not None
        dy, noted = call(t, y, args, u, given, record)
        for value in noted:
            note_value(value)
        return dy

    return traced
