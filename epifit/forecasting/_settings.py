"""The solve's settings of a forecast: the arguments, else the fit's, else
`SolverSettings`' defaults; and their provenance attributes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from epifit.ode import AbstractSolver, PIDController
from epifit.simulation import SOLVERS, SolverSettings

__all__ = ["settings_attrs", "solver_settings"]


def solver_settings(
    stored: Mapping[str, Any], solver, controller, rtol, atol, max_steps
) -> SolverSettings:
    """The solve's settings: the arguments given, else the fit's `stored`
    settings (its solver by class name, tolerances and step budget), else
    `SolverSettings`' defaults."""
    if solver is None:
        name = str(stored.get("solver") or "Tsit5")
        cls = SOLVERS.get(name.lower())
        if cls is None:
            raise ValueError(
                f"The fit's solver {name!r} is not an epifit.ode solver; pass "
                "solver= (e.g. epifit.ode.Tsit5())."
            )
        solver = cls()
    if not isinstance(solver, AbstractSolver):
        raise TypeError(f"solver must be an epifit.ode solver; got {solver!r}.")
    if controller is not None and (rtol is not None or atol is not None):
        raise ValueError("Give rtol/atol or a stepsize_controller, not both.")
    keys = ("rtol", "atol", "max_steps")
    fitted = {k: stored[k] for k in keys if stored.get(k) is not None}
    return SolverSettings.of(
        fitted,
        solver=solver,
        stepsize_controller=controller,
        rtol=rtol,
        atol=atol,
        max_steps=max_steps,
    )


def settings_attrs(solver, controller, max_steps) -> dict[str, Any]:
    """The solve's provenance attributes."""
    return {
        "solver": type(solver).__name__,
        "stepsize_controller": type(controller).__name__,
        **(
            {"rtol": float(controller.rtol), "atol": float(controller.atol)}
            if isinstance(controller, PIDController)
            else {}
        ),
        "max_steps": max_steps,
    }
