"""A fit's settings resolved: defaults < fit configuration < keyword arguments.

[`resolve_fit`][] turns what `calibrate` was given into a [`FitSetup`][]: the
problem with the configuration's parameter overrides, the free parameters, the
objective with its solver settings, the phases, the loop's options, the
multi-start settings and the uncertainty method, every default filled in once
here. Nothing is solved yet.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
from collections.abc import Mapping
from typing import Any

from epifit.fitting._chunk import CAPACITY
from epifit.fitting._config import (
    SETTINGS,
    FitConfig,
    FitConfigError,
    PhaseConfig,
    check_setting,
    known_names,
    load_fit_config,
    merge,
    parse_fit_config,
    parse_phases,
)
from epifit.fitting._methods import AbstractLeastSquaresMethod, make_method
from epifit.fitting._objective import Objective
from epifit.fitting._optimize import OptimizeOptions
from epifit.fitting._overrides import apply_overrides
from epifit.fitting._parameters import (
    AbstractGaussianPrior,
    FreeParameters,
    starting_params,
)
from epifit.simulation import Problem, SolverSettings

__all__ = [
    "FitSetup",
    "check_fit_settings",
    "default_phases",
    "fit_config",
    "resolve_fit",
]

# few enough free parameters for a forward-sensitivity Jacobian per iteration
LM_MAX_PARAMETERS = 20
# above this many free parameters `uncertainty="auto"` skips the Laplace
# approximation (a Jacobian or Hessian with one direction per parameter)
LAPLACE_AUTO_MAX = 300


@dataclasses.dataclass(frozen=True)
class FitSetup:
    """Everything a fit runs with, resolved.

    Attributes:
        problem: the problem, with the configuration's parameter overrides.
        config: the fit configuration, keyword arguments merged in.
        objective: the objective over the free parameters (`objective.free`).
        phases: the optimiser phases (the default ones when none are given).
        options: the loop's tolerances and budgets.
        n_starts, perturbation, seed: the multi-start settings.
        uncertainty: `gauss_newton`, `hessian` or `none` (`auto` resolved).
        skipped: why `auto` skipped the uncertainty, else "".
        level: the interval level.
    """

    problem: Problem
    config: FitConfig
    objective: Objective
    phases: tuple[PhaseConfig, ...]
    options: OptimizeOptions
    n_starts: int
    perturbation: float
    seed: int
    uncertainty: str
    skipped: str
    level: float

    @property
    def free(self) -> FreeParameters:
        return self.objective.free

    def record(self, redraws: list[int], dtype) -> dict[str, Any]:
        """The settings a `FitResult` records (and a checkpoint fingerprints)."""
        options, solver = self.options, self.objective.settings.to_dict()
        return {
            "phases": [p.to_dict() for p in self.phases],
            "tolerance": options.tolerance,
            "loss_tolerance": options.loss_tolerance,
            "patience": options.patience,
            "max_iterations": options.max_iterations,
            "max_retreats": options.max_retreats,
            "n_starts": self.n_starts,
            "perturbation": self.perturbation,
            "seed": self.seed,
            "start_redraws": redraws,
            **{
                k: solver[k] for k in ("rtol", "atol", "max_steps", "adjoint", "solver")
            },
            # only when set: the records of earlier fits still match
            **{k: v for k, v in solver.items() if k == "interpolate_saves"},
            "dtype": str(dtype),
        }


def default_phases(objective: Objective) -> tuple[PhaseConfig, ...]:
    """Levenberg-Marquardt for least squares with few parameters; otherwise
    Adam (200 iterations, learning rate 0.05) then L-BFGS (1000)."""
    if objective.least_squares and objective.free.n <= LM_MAX_PARAMETERS:
        return (PhaseConfig("levenberg_marquardt", 200),)
    return (
        PhaseConfig("adam", 200, options=(("learning_rate", 0.05),)),
        PhaseConfig("lbfgs", 1000),
    )


def check_fit_settings(
    values: Mapping[str, Any],
    *,
    file: str = "calibrate",
    names: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Validate numeric fit settings given outside a fit file (`calibrate`'s
    keywords, the CLI's flags) with the same checks as the fields of a
    `FIT.toml`; `None` means "not given" and is dropped.

    Args:
        values: setting name (`n_starts`, `max_iterations`, `time_budget`,
            `rtol`, ..., `level`) -> value.
        file: what the error names as the source (`"calibrate"`, `"epifit"`).
        names: how the error names each setting (e.g. `{"max_iterations":
            "--max-iterations"}`; default the setting's own name).

    Returns:
        The validated values (NumPy scalars as Python numbers).

    Raises:
        FitConfigError: naming the setting and what it must be, e.g.
            `calibrate: max_iterations: must be an integer >= 1, got -5`.
    """
    names = names or {}
    out = {}
    for key, value in values.items():
        if value is None:
            continue
        if key not in SETTINGS and key != "level":
            raise TypeError(
                f"unknown fit setting {key!r}; known: {', '.join([*SETTINGS, 'level'])}"
            )
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            value = int(value)
        elif isinstance(value, numbers.Real) and not isinstance(value, bool):
            value = float(value)
        out[key] = check_setting(key, value, names.get(key, key), file=file)
    return out


def fit_config(fit, *, optimizer=None, uncertainty=None, **overrides) -> FitConfig:
    """The fit configuration (`fit`: a `FIT.toml` path, a dict, a `FitConfig`
    or `None`) with `calibrate`'s keyword arguments that are not `None`
    replacing its fields."""
    if fit is None:
        config = FitConfig()
    elif isinstance(fit, FitConfig):
        config = fit
    elif isinstance(fit, str | os.PathLike):
        config = load_fit_config(fit)
    elif isinstance(fit, Mapping):
        config = parse_fit_config(fit)
    else:
        raise TypeError(
            "fit must be a FIT.toml path, a dict or a FitConfig; got "
            f"{type(fit).__name__}."
        )
    config = merge(config, **check_fit_settings(overrides))
    if optimizer is not None:
        config = dataclasses.replace(config, phases=parse_phases(optimizer))
    if uncertainty is not None:
        method = {True: "auto", False: "none"}.get(uncertainty, uncertainty)
        config = dataclasses.replace(config, uncertainty=method)
    return config


def resolve_fit(
    problem: Problem,
    config: FitConfig,
    init=None,
    values=None,
    solver=None,
    adjoint=None,
) -> FitSetup:
    """The fit of `problem` that `config` describes, from `init` with
    constrained `values`; `solver` and `adjoint` (instances or names) win over
    the configuration's.

    Raises:
        FitConfigError: an override of an unknown parameter; every parameter
            fixed.
        NotImplementedError: a least-squares method on a loss that is not a
            sum of squares.
    """
    names = [p.name for p in problem.spec.parameters]
    names += [n.name for n in problem.spec.neural]
    known_names(config, names, problem.spec.name)
    problem = apply_overrides(problem, config)
    free = FreeParameters(problem, starting_params(problem, init, values), config)
    if free.n == 0:
        raise FitConfigError(
            "every parameter is fixed; nothing to fit", file=config.source
        )
    settings = SolverSettings.of(
        None,
        solver=solver if solver is not None else config.solver,
        adjoint=adjoint if adjoint is not None else config.adjoint,
        rtol=config.rtol,
        atol=config.atol,
        max_steps=config.max_steps,
        interpolate_saves=config.interpolate_saves,
    )
    objective = Objective(problem, free, settings)
    phases = config.phases or default_phases(objective)
    _check_least_squares(objective, phases)
    method, skipped = _uncertainty_method(config, objective)
    _check_starts_memory(objective, config.n_starts or 1, config.source)
    return FitSetup(
        problem=problem,
        config=config,
        objective=objective,
        phases=phases,
        options=_options(config),
        n_starts=config.n_starts or 1,
        perturbation=0.5 if config.perturbation is None else config.perturbation,
        seed=0 if config.seed is None else config.seed,
        uncertainty=method,
        skipped=skipped,
        level=config.level or 0.95,
    )


def _check_starts_memory(objective: Objective, n_starts: int, source) -> None:
    """Refuse `n_starts` whose states would not fit in memory, before any
    solve: each start holds its trajectory (state x days, and the predictions)
    in batched calls, its optimiser state and its history."""
    problem = objective.problem
    n_state = sum(c.stages for c in problem.spec.compartments) * problem.n_patches
    per_start = 2 * n_state * problem.ts.size + 8 * objective.free.n + 3 * CAPACITY
    need = n_starts * per_start * problem.dtype.itemsize
    limit = _memory_bytes() / 2
    if need > limit:
        raise FitConfigError(
            f"{n_starts} starting points need about {need / 2**30:.3g} GiB ({n_starts}"
            f" starts x ({n_state} state values x {problem.ts.size} days x 2 + "
            f"{objective.free.n} free parameters x 8 + the history) x "
            f"{problem.dtype.itemsize} bytes), more than half this machine's memory "
            f"({2 * limit / 2**30:.3g} GiB); use fewer starts",
            file=source,
            location="n_starts",
        )


def _memory_bytes() -> float:
    """The machine's physical memory (inf where unknown)."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):  # pragma: no cover
        return float("inf")


def _options(config: FitConfig) -> OptimizeOptions:
    return OptimizeOptions(
        tolerance=1e-8 if config.tolerance is None else config.tolerance,
        loss_tolerance=1e-12
        if config.loss_tolerance is None
        else config.loss_tolerance,
        patience=config.patience or 5,
        max_iterations=config.max_iterations,
        time_budget=config.time_budget,
        max_retreats=config.max_retreats or 30,
        chunk_size=config.chunk_size,
    )


def _check_least_squares(objective: Objective, phases) -> None:
    if objective.least_squares:
        return
    for p in phases:
        if isinstance(make_method(p), AbstractLeastSquaresMethod):
            raise NotImplementedError(
                f"Optimiser '{p.method}' needs a least-squares loss: "
                "least_squares observations and only normal priors; this fit has "
                f"{_not_least_squares(objective)}. Use lbfgs or adam."
            )


def _not_least_squares(objective: Objective) -> str:
    parts = [
        f"'{o.name}' {o.family}"
        for o in objective.observations
        if o.family != "least_squares"
    ]
    parts += [
        f"a {type(p).__name__} prior on '{k}'"
        for k, p in objective.free.priors.items()
        if not isinstance(p, AbstractGaussianPrior)
    ]
    return ", ".join(parts)


def _uncertainty_method(config: FitConfig, objective: Objective) -> tuple[str, str]:
    """The uncertainty method with `auto` resolved, and why `auto` skipped it
    ("" when it did not)."""
    method = config.uncertainty or "auto"
    if method != "auto":
        return method, ""
    if objective.free.n > LAPLACE_AUTO_MAX:
        return "none", (
            f"uncertainty skipped: {objective.free.n} free parameters (more than "
            f"{LAPLACE_AUTO_MAX}); pass uncertainty='gauss_newton' or 'hessian' "
            "to compute it"
        )
    return ("gauss_newton" if objective.least_squares else "hessian"), ""
