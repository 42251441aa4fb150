"""Solver failures, and raising them at run time."""

from __future__ import annotations

import enum
import functools

import equinox.internal as eqxi
import jax
import jax.lax as lax
import jax.tree_util as jtu
import numpy as np


class SolverError(RuntimeError):
    """An ODE solve failed: too many steps, a step too small, or a non-finite state."""


class Result(enum.IntEnum):
    """Outcome codes of a solve, stored in `Solution.result`."""

    SUCCESSFUL = 0
    MAX_STEPS_REACHED = 1
    DT_MIN_REACHED = 2
    NONFINITE_STATE = 3


MESSAGES = {
    Result.MAX_STEPS_REACHED: (
        "the maximum number of steps per segment ({max_steps}) was reached; raise "
        "max_steps, loosen rtol/atol, or try a stiff solver such as Kvaerno5()"
    ),
    Result.DT_MIN_REACHED: (
        "the step size fell below its minimum; the problem may be stiff (try "
        "Kvaerno5()) or the tolerances too tight"
    ),
    Result.NONFINITE_STATE: (
        "the state became non-finite (NaN or inf); check the parameters and the "
        "vector field"
    ),
}


def format_failure(
    code: int, segment: int, t: float, t_start: float, t_end: float, max_steps: int
) -> str:
    reason = MESSAGES[Result(code)].format(max_steps=max_steps)
    return (
        f"ODE solve failed in segment {segment} [t={t_start:g}, {t_end:g}] at "
        f"t={t:.6g}: {reason}."
    )


# A segment of the continuous adjoints' backward pass whose forward replay took
# more steps than the dense-output buffer holds (not a `Solution.result` code).
BUFFER_EXCEEDED = 100


def format_backward_failure(
    adjoint: str,
    code: int,
    segment: int,
    t: float,
    t_start: float,
    t_end: float,
    max_steps: int,
    buffer: int | None,
) -> str:
    if code == BUFFER_EXCEEDED:
        reason = (
            f"the forward solve took more than buffer={buffer} steps in this "
            f"segment; raise {adjoint}(buffer=...)"
        )
    else:
        reason = MESSAGES[Result(code)].format(max_steps=max_steps)
    return (
        f"The gradient failed: the backward pass of {adjoint} over segment "
        f"{segment} [t={t_start:g}, {t_end:g}] stopped at t={t:.6g}: {reason}."
    )


def raise_at_run_time(x, failed, check, *operands):
    """`x`, where nothing `failed`; else `check(*operands)` is called on the
    host, and raises (under `vmap` once per lane, in order).

    For a value known only at run time (under `jit`). `failed` is a boolean
    (batched under `vmap`: any lane fails the whole call), `operands` what
    the message needs; `check` raises when given a failed lane's operands.
    `x` passes through, its tangent too (the check is invisible to
    differentiation).

    A `jax.pure_callback` inside a `cond`, tied to `x` by a data dependency
    (as `equinox.error_if` does): no side effect in the program. A
    `jax.debug.callback`, even one never called, is an effect, and JAX then
    dispatches every call of the compiled program from Python: 0.5-0.65 ms a
    call on the reference problem's 9 ms loss (`epifit/ode/README.md`).
    """
    failed = eqxi.unvmap_any(failed)
    operands = tuple(lax.stop_gradient(v) for v in operands)
    return _checked(check, x, failed, operands)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _checked(check, x, failed, operands):
    shapes = jax.eval_shape(lambda: x)

    def host(*ops):
        check(*ops)  # raises where the lane failed; a lane that did not
        # fail (under `vmap`, before the one that does) returns a filler
        return jtu.tree_map(lambda s: np.zeros(s.shape, s.dtype), shapes)

    def fail(x):
        return jax.pure_callback(host, shapes, *operands, vmap_method="sequential")

    return lax.cond(failed, fail, lambda x: x, x)


@_checked.defjvp
def _checked_jvp(check, primals, tangents):
    x, failed, operands = primals
    return _checked(check, x, failed, operands), tangents[0]
