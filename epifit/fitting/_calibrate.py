"""`calibrate`: fit a model to data, with uncertainty."""

from __future__ import annotations

import dataclasses
import os
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from epifit.data import Gaussian
from epifit.fitting._checkpoint import (
    CheckpointError,
    checkpoint_phase,
    fingerprint,
    load_checkpoint,
    remove_stale,
    save_checkpoint,
)
from epifit.fitting._config import (
    FitConfig,
    FitConfigError,
    PhaseConfig,
    known_names,
    load_fit_config,
    merge,
    parse_fit_config,
    parse_phases,
)
from epifit.fitting._methods import AbstractLeastSquaresMethod, make_method
from epifit.fitting._objective import Objective
from epifit.fitting._optimize import (
    GRADIENT,
    LOSS,
    NONFINITE,
    STATUS,
    OptimizeOptions,
    Optimizer,
)
from epifit.fitting._parameters import (
    AbstractGaussianPrior,
    FreeParameters,
    apply_overrides,
    constrained_dict,
    free_entries,
    leaf_labels,
    starting_params,
)
from epifit.fitting._progress import ProgressBar, progress_enabled
from epifit.fitting._result import FitResult, library_versions
from epifit.fitting._uncertainty import laplace, parameter_table
from epifit.ode import AbstractAdjoint, AbstractSolver
from epifit.simulation import Problem, SolverSettings, trajectory_dataset

__all__ = ["calibrate", "default_phases"]

# few enough free parameters for a forward-sensitivity Jacobian per iteration
LM_MAX_PARAMETERS = 20
# above this many free parameters `uncertainty="auto"` skips the Laplace
# approximation (a Jacobian or Hessian with one direction per parameter)
LAPLACE_AUTO_MAX = 300


def default_phases(objective: Objective) -> tuple[PhaseConfig, ...]:
    """Levenberg-Marquardt for least squares with few parameters; otherwise
    Adam (200 iterations, learning rate 0.05) then L-BFGS (1000)."""
    if objective.least_squares and objective.free.n <= LM_MAX_PARAMETERS:
        return (PhaseConfig("levenberg_marquardt", 200),)
    return (
        PhaseConfig("adam", 200, options=(("learning_rate", 0.05),)),
        PhaseConfig("lbfgs", 1000),
    )


def _fit_config(fit) -> FitConfig:
    if fit is None:
        return FitConfig()
    if isinstance(fit, FitConfig):
        return fit
    if isinstance(fit, str | os.PathLike):
        return load_fit_config(fit)
    if isinstance(fit, Mapping):
        return parse_fit_config(fit)
    raise TypeError(
        f"fit must be a FIT.toml path, a dict or a FitConfig; got {type(fit).__name__}."
    )


def calibrate(
    model_or_problem,
    data=None,
    *,
    fit: str | os.PathLike | Mapping[str, Any] | FitConfig | None = None,
    optimizer: str | Mapping[str, Any] | Sequence[Any] | None = None,
    init=None,
    values: str | os.PathLike | Mapping[str, Any] | None = None,
    adjoint: AbstractAdjoint | str | None = None,
    solver: AbstractSolver | str | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    max_steps: int | None = None,
    max_iterations: int | None = None,
    tolerance: float | None = None,
    loss_tolerance: float | None = None,
    time_budget: float | None = None,
    n_starts: int | None = None,
    perturbation: float | None = None,
    seed: int | None = None,
    uncertainty: bool | str | None = None,
    level: float | None = None,
    checkpoint: str | os.PathLike | None = None,
    checkpoint_every: int | None = None,
    resume: bool = False,
    chunk_size: int | None = None,
    progress: bool | str = "auto",
) -> FitResult:
    """Fit a model's free parameters to data.

    Settings come from the defaults, overridden by the fit configuration
    (`fit`, a `FIT.toml` file or the same tables as a dict), overridden by the
    keyword arguments given here.

    Args:
        model_or_problem: a [`Problem`][epifit.Problem], or a model (TOML path,
            `ModelSpec`, `CompiledModel`) to bind to `data`.
        data: the dataset (or netCDF path) when a model is given.
        fit: a fit configuration: phases, tolerances, multi-start, parameter
            overrides (value, fixed, transform, bounds, prior, l2) and
            uncertainty settings; see `docs/calibration.md`.
        optimizer: phases, overriding the configuration's: a method name
            (`"lbfgs"`, `"adam"`, `"rmsprop"`, `"sgd"`, `"levenberg_marquardt"`,
            `"gauss_newton"`), one phase dict, or a list of them, e.g.
            `[{"method": "adam", "iterations": 200, "learning_rate": 0.05},
            {"method": "lbfgs", "iterations": 200}]`. Default: Levenberg-
            Marquardt for least squares with at most 20 free parameters, else
            Adam then L-BFGS.
        init: the starting parameters: an unconstrained parameter pytree or a
            `FitResult` (default: the model's initial values).
        values: constrained starting values overriding those (a mapping or a
            TOML/JSON file of `name = value`).
        adjoint: an `epifit.ode` adjoint or its name (default checkpoint).
        solver: an `epifit.ode` solver or its name (default Tsit5).
        rtol, atol: solver tolerances (default 1e-6, 1e-9).
        max_steps: solver steps per segment (default 4096).
        max_iterations: a cap on iterations over all phases.
        tolerance: stop a phase when `max|gradient| <= tolerance * max(1,
            |loss|)` (default 1e-8).
        loss_tolerance: ... or when the relative loss change stays below it
            for `patience` iterations (default 1e-12).
        time_budget: seconds; checked between chunks of iterations.
        n_starts: starting points, optimised in the same compiled calls (one
            after another on CPU, batched by `vmap` on accelerators): the
            initial point and `n_starts - 1` seeded perturbations of it; the
            best final loss wins (default 1). A perturbed start whose loss is
            not finite is drawn again, up to 20 times (the result's
            `settings["start_redraws"]` counts them).
        perturbation: the standard deviation of the perturbations, in
            unconstrained coordinates (default 0.5).
        seed: seeds the perturbations (default 0).
        uncertainty: `True`/`"auto"` (Gauss-Newton for least squares, else the
            Hessian), `"gauss_newton"`, `"hessian"`, or `False`/`"none"`.
        level: the interval level (default 0.95).
        checkpoint: a file to checkpoint the optimiser state to, atomically,
            every `checkpoint_every` iterations (and when the time budget ends
            the fit).
        checkpoint_every: iterations between checkpoints (default 50 when a
            checkpoint file is given).
        resume: continue from `checkpoint` if it exists (same result as an
            uninterrupted run).
        chunk_size: iterations per compiled chunk (default adaptive, about
            half a second each).
        progress: show a progress bar on stderr: `True`, `False`, or `"auto"`
            (when stderr is a terminal or a notebook).

    Returns:
        A [`FitResult`][epifit.FitResult].

    Raises:
        FitConfigError: a bad fit configuration (naming file and field).
        NotImplementedError: a least-squares method on a non-gaussian fit.
        FloatingPointError: a non-finite loss at every starting point.
        CheckpointError: a checkpoint that belongs to a different fit.
    """
    wall = time.perf_counter()
    if isinstance(model_or_problem, Problem):
        if data is not None:
            raise ValueError("Give data only with a model, not with a Problem.")
        problem = model_or_problem
    else:
        if data is None:
            raise ValueError("calibrate needs data: calibrate(model, data, ...).")
        problem = Problem(model_or_problem, data)
    config = merge(
        _fit_config(fit),
        rtol=rtol,
        atol=atol,
        max_steps=max_steps,
        max_iterations=max_iterations,
        tolerance=tolerance,
        loss_tolerance=loss_tolerance,
        time_budget=time_budget,
        n_starts=n_starts,
        perturbation=perturbation,
        seed=seed,
        level=level,
        checkpoint_every=checkpoint_every,
        chunk_size=chunk_size,
    )
    if optimizer is not None:
        config = dataclasses.replace(config, phases=parse_phases(optimizer))
    if uncertainty is not None:
        method = {True: "auto", False: "none"}.get(uncertainty, uncertainty)
        config = dataclasses.replace(config, uncertainty=method)
    names = [p.name for p in problem.spec.parameters]
    names += [n.name for n in problem.spec.neural]
    known_names(config, names, problem.spec.name)
    problem = apply_overrides(problem, config)

    # -- starting point and objective --
    params = starting_params(problem, init, values)
    free = FreeParameters(problem, params, config)
    if free.n == 0:
        raise FitConfigError(
            "every parameter is fixed; nothing to fit", file=config.source
        )
    solver_settings = SolverSettings.of(
        None,
        solver=solver if solver is not None else config.solver,
        adjoint=adjoint if adjoint is not None else config.adjoint,
        rtol=config.rtol,
        atol=config.atol,
        max_steps=config.max_steps,
    )
    objective = Objective(problem, free, solver_settings)
    phases = config.phases or default_phases(objective)
    if not objective.least_squares:
        for p in phases:
            if isinstance(make_method(p), AbstractLeastSquaresMethod):
                raise NotImplementedError(
                    f"Optimiser '{p.method}' needs a least-squares loss: gaussian "
                    "observations and only normal priors; this fit has "
                    f"{_not_least_squares(objective)}. Use lbfgs or adam."
                )
    n_starts = config.n_starts or 1
    seed = 0 if config.seed is None else config.seed
    spread = 0.5 if config.perturbation is None else config.perturbation
    data = objective.data()
    xs, redraws = finite_starts(
        lambda d: free.starts(free.x0, n_starts, spread, seed, d),
        objective.compiled("loss") if n_starts > 1 else None,
        data,
    )

    options = OptimizeOptions(
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
    solved = solver_settings.to_dict()
    settings = {
        "phases": [p.to_dict() for p in phases],
        "tolerance": options.tolerance,
        "loss_tolerance": options.loss_tolerance,
        "patience": options.patience,
        "max_iterations": options.max_iterations,
        "max_retreats": options.max_retreats,
        "n_starts": n_starts,
        "perturbation": spread,
        "seed": seed,
        "start_redraws": redraws,
        **{k: solved[k] for k in ("rtol", "atol", "max_steps", "adjoint", "solver")},
        "dtype": str(xs.dtype),
    }

    # -- checkpointing --
    every = config.checkpoint_every
    if checkpoint is not None:
        checkpoint = Path(checkpoint)
        every = every or 50
    elif resume:
        raise ValueError("resume=True needs a checkpoint file (checkpoint=...).")
    key = None
    save = None
    if checkpoint is not None:
        key = fingerprint(
            spec=problem.spec, arrays=data, xs=xs, settings=_numeric(settings)
        )

        def save(snapshot):
            save_checkpoint(checkpoint, snapshot["carry"], snapshot["record"], key)

    optimizer_ = Optimizer(
        objective,
        phases,
        options,
        checkpoint=save,
        checkpoint_every=every,
    )
    resumed = None
    if resume and checkpoint.exists():
        remove_stale(checkpoint)
        p = checkpoint_phase(checkpoint)
        if p >= len(phases):
            raise CheckpointError(
                f"Checkpoint {checkpoint} is for phase {p + 1}, but this fit has "
                f"{len(phases)} phase(s). Delete it to start afresh."
            )
        resumed = load_checkpoint(checkpoint, optimizer_.template(p, xs, data), key)
    elif resume:
        print(
            f"epifit: no checkpoint {checkpoint} yet; starting from the beginning",
            file=sys.stderr,
        )

    # -- optimise --
    show = progress_enabled(progress)
    t_opt = time.perf_counter()
    if show:
        with ProgressBar(phases, n_starts=n_starts) as bar:
            optimizer_.progress = bar
            out = optimizer_.run(xs, data, resume=resumed)
    else:
        out = optimizer_.run(xs, data, resume=resumed)
    optimize_s = time.perf_counter() - t_opt
    carry, record = out["carry"], out["record"]

    # -- the best start --
    f_all = np.asarray(carry.f, np.float64)
    best = int(np.argmin(np.where(np.isfinite(f_all), f_all, np.inf)))
    x_best = carry.x[best]
    statuses = [s[best] for s in record["statuses"]]
    final = statuses[-1] if statuses else NONFINITE
    converged = (
        out["stop_reason"] is None
        and final in (GRADIENT, LOSS)
        and len(statuses) == len(phases)
    )
    if out["stop_reason"] is not None:
        message = out["stop_reason"]
    elif final == NONFINITE:
        died = statuses.index(NONFINITE)
        message = (
            f"stopped: the loss or its gradient stayed non-finite for "
            f"{options.max_retreats} retreats in a row (phase {died + 1}: "
            f"{phases[died].method}); returning the last good state"
        )
        warnings.warn(message, RuntimeWarning, stacklevel=2)
    elif final in (GRADIENT, LOSS):
        message = STATUS[final]
    else:
        message = "stopped: iteration limit of the last phase reached"
    hist = record["history"]

    # -- results --
    fitted = free.params(x_best, data["rest"])
    method = config.uncertainty or "auto"
    skipped = ""
    if method == "auto":
        method = "gauss_newton" if objective.least_squares else "hessian"
        if free.n > LAPLACE_AUTO_MAX:
            method = "none"
            skipped = (
                f"uncertainty skipped: {free.n} free parameters (more than "
                f"{LAPLACE_AUTO_MAX}); pass uncertainty='gauss_newton' or 'hessian' "
                "to compute it"
            )
    level_ = config.level or 0.95
    # one batched call at the best point, of the executable the optimiser used
    xb = jnp.broadcast_to(x_best, xs.shape)
    jac = None
    if method == "gauss_newton":
        r, J, ys, stats, result = objective.compiled("jacobian_and_solution")(xb, data)
        jac = (r[0], J[0])
    else:
        ys, stats, result = objective.compiled("solution")(xb, data)
    if int(result[0]) != 0:
        raise RuntimeError(
            "The solve at the fitted parameters failed (result code "
            f"{int(result[0])}); try tighter solver tolerances or more max_steps."
        )
    first = lambda a: np.asarray(a)[0]  # noqa: E731
    sol = SimpleNamespace(ys=jax.tree.map(first, ys), stats=jax.tree.map(first, stats))
    trajectories = trajectory_dataset(problem, fitted, sol)
    cov = None
    unc: dict[str, Any] = {"method": "none", "level": level_, "message": skipped}
    if method != "none":
        lap = laplace(
            objective,
            x_best,
            data,
            method=method,
            noise=config.noise or "auto",
            jacobian=jac,
            loss=float(f_all[best]),
        )
        cov = lap.covariance
        unc = {
            "method": lap.method,
            "level": level_,
            "noise_variance": lap.noise_variance,
            "message": lap.message,
        }
    table = parameter_table(objective, x_best, data, cov, level=level_)
    arrays, _ = eqx.partition(fitted, eqx.is_inexact_array)
    coefficients = np.asarray(ravel_pytree(arrays)[0])
    free_flags = free_entries(fitted, problem.model.free_mask(fitted))
    per_patch = {p.name for p in problem.spec.parameters if p.per_patch}
    coef_labels, _ = leaf_labels(arrays, problem.patches, per_patch)
    model_path = problem.model_path
    model_text = (
        Path(model_path).read_text() if model_path and Path(model_path).exists() else ""
    )
    return FitResult(
        params=fitted,
        values=constrained_dict(problem, fitted),
        table=table,
        loss=float(f_all[best]),
        iterations=int(record["iteration"]),
        converged=bool(converged),
        message=message,
        loss_history=hist["loss"][best],
        grad_norm_history=hist["grad_norm"][best],
        step_history=hist["step"][best],
        phase_history=hist["phase"][best].astype(np.int64),
        labels=free.labels,
        x=np.asarray(x_best),
        covariance=cov,
        coefficients=coefficients,
        coefficient_labels=tuple(coef_labels),
        coefficient_free=free_flags,
        start_losses=f_all,
        initial_losses=np.asarray(record["initial_loss"]),
        best_start=best,
        uncertainty=unc,
        settings=settings,
        solver_stats={k: int(np.asarray(v)) for k, v in sol.stats.items()},
        timing={
            "wall_s": time.perf_counter() - wall,
            "optimize_s": optimize_s,
            "optimize_total_s": float(record["elapsed"]),
        },
        trajectories=trajectories,
        problem=problem,
        model_text=model_text,
        fit_config=dict(config.raw),
        hashes=problem.hashes(),
        versions=library_versions(),
    )


MAX_REDRAWS = 20


def finite_starts(draw, loss, data):
    """Starting points at which the loss is finite, and how often each was
    drawn again.

    `draw(d)` gives the starting points of draw `d` (`x0` first, then the
    perturbed points); `loss(xs, data)` their losses (`None`: one start, kept
    as it is). A perturbed start whose loss is not finite (its solve fails,
    or a likelihood is zero: an epidemic burnt out where cases are observed)
    is replaced by the same start of the next draw, up to `MAX_REDRAWS`
    times; a start still non-finite after that is kept, and the optimiser
    reports it. `x0` is never replaced. Deterministic: the same seed gives
    the same points, so a resumed fit finds its checkpoint.
    """
    xs = draw(0)
    redraws = [0] * xs.shape[0]
    if loss is None:
        return xs, redraws
    f = np.asarray(loss(xs, data))
    for d in range(1, MAX_REDRAWS + 1):
        bad = ~np.isfinite(f)
        bad[0] = False
        if not bad.any():
            break
        fresh = draw(d)
        xs = jnp.where(jnp.asarray(bad)[:, None], fresh, xs)
        for i in np.flatnonzero(bad):
            redraws[i] += 1
        f = np.asarray(loss(xs, data))
    return xs, redraws


def _not_least_squares(objective: Objective) -> str:
    parts = [
        f"'{o.name}' {o.family}"
        for o in objective.observations
        if not issubclass(objective.families[o.name], Gaussian)
    ]
    parts += [
        f"a {type(p).__name__} prior on '{k}'"
        for k, p in objective.free.priors.items()
        if not isinstance(p, AbstractGaussianPrior)
    ]
    return ", ".join(parts)


def _numeric(settings: dict) -> dict:
    """The settings that change the numbers (not budgets or bookkeeping)."""
    drop = {"max_iterations"}
    return {k: v for k, v in settings.items() if k not in drop}
