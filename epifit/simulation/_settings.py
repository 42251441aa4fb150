"""Solver settings: one object holds the solver, its tolerances, the step
budget and the adjoint, with epifit's defaults written once."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from epifit.ode import (
    RK4,
    AbstractAdaptiveSolver,
    AbstractAdjoint,
    AbstractSolver,
    AbstractStepSizeController,
    BacksolveAdjoint,
    Bosh3,
    CheckpointAdjoint,
    ConstantStepSize,
    Dopri5,
    Euler,
    ForwardAdjoint,
    InterpolatingAdjoint,
    Kvaerno3,
    Kvaerno5,
    PIDController,
    QuadratureAdjoint,
    Tsit5,
)

__all__ = ["ADJOINTS", "SOLVERS", "SolverSettings"]

SOLVERS: dict[str, type[AbstractSolver]] = {
    "tsit5": Tsit5,
    "dopri5": Dopri5,
    "bosh3": Bosh3,
    "kvaerno3": Kvaerno3,
    "kvaerno5": Kvaerno5,
    "rk4": RK4,
    "euler": Euler,
}
"""Solver names, as fit files, scenario runs and the CLI write them."""

ADJOINTS: dict[str, type[AbstractAdjoint]] = {
    "checkpoint": CheckpointAdjoint,
    "backsolve": BacksolveAdjoint,
    "interpolating": InterpolatingAdjoint,
    "quadrature": QuadratureAdjoint,
    "forward": ForwardAdjoint,
}
"""Adjoint names, as fit files and the CLI write them."""


def _named(kind: str, table: Mapping[str, type], value, base: type):
    if value is None or isinstance(value, base):
        return value
    if isinstance(value, str):
        key = value.lower()
        if key not in table:
            raise ValueError(
                f"unknown {kind} {value!r}; expected one of: {', '.join(table)}"
            )
        return table[key]()
    raise TypeError(f"{kind} must be an epifit.ode {kind} or its name; got {value!r}.")


def _check_interpolation(settings) -> None:
    """`interpolate_saves=True`'s needs (as `epifit.ode.solve` checks them),
    refused when the settings are made, not at the first solve."""
    adjoint = settings.adjoint or CheckpointAdjoint()
    controller = settings.stepsize_controller
    if isinstance(controller, ConstantStepSize):
        raise ValueError(
            "interpolate_saves=True needs an adaptive step-size controller; "
            "fixed steps already land on the save times."
        )
    if not getattr(settings.solver, "has_dense_output", False):
        raise ValueError(
            "interpolate_saves=True needs a solver with a dense output (tsit5, "
            f"bosh3, dopri5); got {type(settings.solver).__name__}."
        )
    if not adjoint.differentiates_inner_saves:
        raise ValueError(
            "interpolate_saves=True is differentiated by the checkpoint adjoint "
            f"(unroll_first, no keep_first) or the forward one; got {adjoint!r}."
        )


@dataclasses.dataclass(frozen=True)
class SolverSettings:
    """How a model is solved: solver, step-size control, step budget, adjoint.

    The one place that holds epifit's defaults: Tsit5 with a PID controller at
    `rtol = 1e-6`, `atol = 1e-9`, at most 4096 steps per segment, the
    checkpoint adjoint (the ODE core's default). `solver` and `adjoint` may be
    given by name (`"tsit5"`, `"kvaerno5"`, `"backsolve"`, ... see `SOLVERS`
    and `ADJOINTS`).

    Attributes:
        solver: an `epifit.ode` solver.
        rtol, atol: the PID controller's tolerances (ignored when
            `stepsize_controller` is given).
        max_steps: steps per segment before the solve fails.
        adjoint: an `epifit.ode` adjoint, or `None` for the ODE core's default
            (`CheckpointAdjoint`).
        dt0: the first step, or `None` for the ODE core's heuristic.
        stepsize_controller: a controller replacing the PID controller built
            from `rtol` and `atol`.
        interpolate_saves: save the states at the days by the solver's
            dense output instead of stepping to each (`epifit.ode.solve`'s
            `interpolate_saves`): far fewer steps where the solution is
            smooth over several days; nothing gained where the inputs change
            every day.
    """

    solver: AbstractSolver = dataclasses.field(default_factory=Tsit5)
    rtol: float = 1e-6
    atol: float = 1e-9
    max_steps: int = 4096
    adjoint: AbstractAdjoint | None = None
    dt0: float | None = None
    stepsize_controller: AbstractStepSizeController | None = None
    interpolate_saves: bool = False

    def __post_init__(self):
        solver = _named("solver", SOLVERS, self.solver, AbstractSolver)
        adjoint = _named("adjoint", ADJOINTS, self.adjoint, AbstractAdjoint)
        object.__setattr__(self, "solver", Tsit5() if solver is None else solver)
        object.__setattr__(self, "adjoint", adjoint)
        for name in ("rtol", "atol"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and value > 0):
                raise ValueError(f"{name} must be a number > 0; got {value!r}.")
        if isinstance(self.max_steps, bool) or not (
            isinstance(self.max_steps, int) and self.max_steps >= 1
        ):
            raise ValueError(
                f"max_steps must be an integer >= 1; got {self.max_steps!r}."
            )
        controller = self.stepsize_controller
        if controller is not None and not isinstance(
            controller, AbstractStepSizeController
        ):
            raise TypeError(
                "stepsize_controller must be an epifit.ode controller; got "
                f"{controller!r}."
            )
        if not isinstance(self.interpolate_saves, bool):
            raise TypeError(
                "interpolate_saves must be True or False; got "
                f"{self.interpolate_saves!r}."
            )
        if self.interpolate_saves:
            _check_interpolation(self)
        if controller is None and not isinstance(self.solver, AbstractAdaptiveSolver):
            raise ValueError(
                f"{type(self.solver).__name__}() has no error estimate for a PID "
                "controller; give stepsize_controller=ConstantStepSize(dt0=...)."
            )

    @classmethod
    def of(cls, settings: SolverSettings | Mapping[str, Any] | None = None, **kw):
        """`settings` (a `SolverSettings`, a mapping of its fields or `None`)
        with the fields in `kw` that are not `None` replacing its own."""
        if settings is None:
            base = cls()
        elif isinstance(settings, SolverSettings):
            base = settings
        elif isinstance(settings, Mapping):
            base = cls(**settings)
        else:
            raise TypeError(
                "solver settings must be a SolverSettings or a mapping; got "
                f"{settings!r}."
            )
        given = {k: v for k, v in kw.items() if v is not None}
        return dataclasses.replace(base, **given) if given else base

    @property
    def controller(self) -> AbstractStepSizeController:
        """The step-size controller: `stepsize_controller`, or the PID
        controller of `rtol` and `atol`."""
        if self.stepsize_controller is not None:
            return self.stepsize_controller
        return PIDController(rtol=self.rtol, atol=self.atol)

    def solve_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of `epifit.ode.solve` that these settings set."""
        return dict(
            solver=self.solver,
            stepsize_controller=self.controller,
            adjoint=self.adjoint,
            max_steps=self.max_steps,
            dt0=self.dt0,
            interpolate_saves=self.interpolate_saves,
        )

    def to_dict(self) -> dict[str, Any]:
        """The settings as plain values, for provenance attributes and
        checkpoint fingerprints: class names and numbers."""
        adjoint = CheckpointAdjoint() if self.adjoint is None else self.adjoint
        # written only when set, so the records of earlier runs still match
        extra = {"interpolate_saves": True} if self.interpolate_saves else {}
        return {
            "solver": type(self.solver).__name__,
            "stepsize_controller": type(self.controller).__name__,
            "rtol": float(self.rtol),
            "atol": float(self.atol),
            "max_steps": int(self.max_steps),
            "adjoint": type(adjoint).__name__,
            "dt0": None if self.dt0 is None else float(self.dt0),
            **extra,
        }
