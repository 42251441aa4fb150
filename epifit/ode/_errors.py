"""Solver failures."""

from __future__ import annotations

import enum


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
