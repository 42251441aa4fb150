"""`calibrate`: fit a model to data, with uncertainty.

A fit is a composition of small steps: resolve the settings
(`epifit.fitting._resolve`), draw starting points with a finite loss
(`finite_starts`), run the phases (`Optimizer`, with checkpoints and a progress
bar), pick the best start, compute the uncertainty there (for a Gauss-Newton
Laplace approximation from the Jacobian and the solve of one batched call),
then every other number of the result in one compiled output program
(`epifit.fitting._output`: the solve, R_eff, the parameter table's pieces,
the log-likelihood for AIC and BIC, the range check's values), and build the
`FitResult` from them in NumPy.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from epifit._paths import remove_stale_temporaries
from epifit.fitting._checkpoint import (
    CheckpointError,
    checkpoint_phase,
    fingerprint,
    load_checkpoint,
    save_checkpoint,
)
from epifit.fitting._chunk import GRADIENT, LOSS, NONFINITE, STATUS, Carry
from epifit.fitting._config import FitConfig, PhasesLike
from epifit.fitting._diagnose import NonFiniteStartError, explain_nonfinite
from epifit.fitting._information import fit_information
from epifit.fitting._optimize import Optimizer
from epifit.fitting._output import (
    check_solve,
    coefficients,
    fit_numbers,
    gauss_newton_solve,
)
from epifit.fitting._progress import ProgressBar, progress_enabled
from epifit.fitting._resolve import FitSetup, fit_config, resolve_fit
from epifit.fitting._result import FitResult, library_versions
from epifit.fitting._uncertainty import interval_note, laplace, table_rows
from epifit.ode import AbstractAdjoint, AbstractSolver
from epifit.simulation import Problem, trajectory_dataset

__all__ = ["MAX_REDRAWS", "calibrate", "finite_starts"]

MAX_REDRAWS = 20
# a last iterate worse than the best point seen by less than this (relative)
# is not a regression: the loss through an adaptive solve is no more accurate
# than the solver's tolerance, and an optimiser ending at its minimum wobbles
# about it by rounding (L-BFGS below its gradient tolerance, say)
REGRESSION_RTOL = 1e-8


def calibrate(
    model_or_problem,
    data=None,
    *,
    fit: str | os.PathLike | Mapping[str, Any] | FitConfig | None = None,
    optimizer: PhasesLike | None = None,
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
    """Fit a model's free parameters to data, with uncertainty.

    Settings come from the defaults, overridden by the fit configuration `fit`
    (a `FIT.toml` path, the same tables as a dict, or a `FitConfig`),
    overridden by the keyword arguments given here. A keyword named like a
    `FIT.toml` field (`rtol`, `atol`, `max_steps`, `max_iterations`,
    `tolerance`, `loss_tolerance`, `time_budget`, `n_starts`, `perturbation`,
    `seed`, `level`, `checkpoint_every`, `chunk_size`; `adjoint` and `solver`,
    also as `epifit.ode` objects) means what the field means, defaults
    included (see `docs/calibration.md`).

    Args:
        model_or_problem: a [`Problem`][epifit.Problem], or a model (TOML path,
            `ModelSpec`, `CompiledModel`) to bind to `data` (a dataset or path).
        optimizer: phases replacing the configuration's: a method name, an
            `optax.GradientTransformation` (a first-order phase like Adam), a
            phase dict, or a list of them, e.g.
            `[optax.adam(1e-2), {"method": "lbfgs", "iterations": 50}]`.
        init: the start: an unconstrained parameter pytree or a `FitResult`
            (default: the model's values); `values`: constrained values on top
            (a mapping or a TOML/JSON file).
        uncertainty: `True`/`"auto"`, `"gauss_newton"`, `"hessian"`, `False`/`"none"`.
        checkpoint: a file the optimiser's state is saved to atomically;
            `resume=True` continues from it, to the same numbers.
        progress: a progress bar on stderr: `True`, `False` or `"auto"`.

    Returns:
        A [`FitResult`][epifit.FitResult].

    Raises:
        FitConfigError: a bad fit configuration (naming file and field).
        NotImplementedError: a least-squares method on observations that are
            not all least_squares.
        NonFiniteStartError: a non-finite loss at every starting point (a
            `FloatingPointError` and a `LocatedError`), saying why at the first.
        CheckpointError: a checkpoint that belongs to a different fit.
    """
    wall = time.perf_counter()
    problem = _bind(model_or_problem, data)
    config = fit_config(
        fit,
        optimizer=optimizer,
        uncertainty=uncertainty,
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
    setup = resolve_fit(
        problem, config, init=init, values=values, solver=solver, adjoint=adjoint
    )
    data = setup.objective.data()
    opt = Optimizer(setup.objective, setup.phases, setup.options)
    xs, redraws, first = _starts(setup, opt, data)
    settings = setup.record(redraws, xs.dtype)
    resumed = _checkpointing(opt, setup, xs, data, settings, checkpoint, resume)
    out, optimize_s = _optimize(opt, xs, data, resumed, progress, setup, problem, first)
    outcome = _outcome(out, setup)  # best_start, converged, message
    fields, numbers = _fit_result(setup, out, outcome["best_start"], xs, data)
    _check_ranges(setup.problem, numbers, outcome)
    timing = _timing(wall, optimize_s, out["record"])
    return FitResult(**outcome, **fields, settings=settings, timing=timing)


def _check_ranges(problem: Problem, numbers, outcome: dict) -> None:
    """A fitted point that takes a rate, probability or initial condition out
    of its range (through a parameter whose transform does not keep it there,
    e.g. `rate = "a - b"` with identity transforms) is not a valid model: the
    message names the field and `converged` is False. `numbers`: the output
    program's (`fit_numbers`: the constrained and daily values, NumPy)."""
    broken = problem.model.range_violations(numbers.values, numbers.daily)
    if broken:
        more = f" (and {len(broken) - 1} more)" if len(broken) > 1 else ""
        outcome["message"] = (
            f"{outcome['message']}; the fitted values break the model: "
            f"{broken[0]}{more}; give its parameters transforms that keep it in "
            "range (softplus, sigmoid)"
        )
        outcome["converged"] = False


def _bind(model_or_problem, data) -> Problem:
    """The problem: given, or the model bound to `data`."""
    if isinstance(model_or_problem, Problem):
        if data is not None:
            raise ValueError("Give data only with a model, not with a Problem.")
        return model_or_problem
    if data is None:
        raise ValueError("calibrate needs data: calibrate(model, data, ...).")
    return Problem(model_or_problem, data)


def _starts(setup: FitSetup, optimizer: Optimizer, data):
    """The starting points `(start, n)`, how often each was drawn again, and
    their evaluated first carry (None for one start: the run evaluates it).
    Several starts are screened by the optimiser's own first evaluation
    (`Optimizer.first_carry`), so no loss program is compiled for them, and
    the run goes on from the carry of the points kept."""
    free, n = setup.free, setup.n_starts
    last = {}

    def loss(xs, data):
        last["carry"] = optimizer.first_carry(xs, data)
        return np.asarray(last["carry"].f)

    xs, redraws = finite_starts(
        lambda d: free.starts(free.x0, n, setup.perturbation, setup.seed, d),
        loss if n > 1 else None,
        data,
    )
    return xs, redraws, last.get("carry")


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
        xs = jax.device_put(np.where(bad[:, None], np.asarray(fresh), np.asarray(xs)))
        for i in np.flatnonzero(bad):
            redraws[i] += 1
        f = np.asarray(loss(xs, data))
    return xs, redraws


def _checkpointing(
    optimizer: Optimizer, setup: FitSetup, xs, data, settings: dict, checkpoint, resume
):
    """`optimizer` set to save checkpoints to `checkpoint` (every
    `checkpoint_every` iterations, default 50); the state to resume from
    (None: start afresh)."""
    every = setup.config.checkpoint_every
    if checkpoint is not None:
        checkpoint = Path(checkpoint)
        every = every or 50
    elif resume:
        raise ValueError("resume=True needs a checkpoint file (checkpoint=...).")
    key = save = None
    if checkpoint is not None:
        key = fingerprint(
            spec=setup.problem.spec, arrays=data, xs=xs, settings=_numeric(settings)
        )

        def save(snapshot):
            save_checkpoint(checkpoint, snapshot["carry"], snapshot["record"], key)

    optimizer.checkpoint, optimizer.checkpoint_every = save, every
    if not resume:
        return None
    if not checkpoint.exists():
        print(
            f"epifit: no checkpoint {checkpoint} yet; starting from the beginning",
            file=sys.stderr,
        )
        return None
    remove_stale_temporaries(checkpoint)
    p = checkpoint_phase(checkpoint)
    if p >= len(setup.phases):
        raise CheckpointError(
            f"Checkpoint {checkpoint} is for phase {p + 1}, but this fit has "
            f"{len(setup.phases)} phase(s). Delete it to start afresh."
        )
    return load_checkpoint(checkpoint, optimizer.template(p, xs, data), key)


def _optimize(
    optimizer: Optimizer, xs, data, resumed, progress, setup: FitSetup, problem, first
):
    """Run the phases (from `first`, the starts' evaluated carry, if given),
    with a progress bar when `progress` says so; the run's output and its
    seconds. A loss not finite at any start is an error saying why at the
    first (parameters named against `problem`, before overrides)."""
    t = time.perf_counter()
    first = None if resumed is not None else first
    try:
        if progress_enabled(progress):
            with ProgressBar(setup.phases, n_starts=setup.n_starts) as bar:
                optimizer.progress = bar
                out = optimizer.run(xs, data, resume=resumed, first=first)
        else:
            out = optimizer.run(xs, data, resume=resumed, first=first)
    except NonFiniteStartError as e:
        why = explain_nonfinite(setup.objective, xs[0], data, problem)
        raise NonFiniteStartError(
            f"The loss or its gradient is not finite at every starting point; at "
            f"the first: {why}."
        ) from e
    return out, time.perf_counter() - t


def _outcome(out: dict, setup: FitSetup) -> dict[str, Any]:
    """`best_start`, `converged` and `message` (why the fit stopped; warned
    when the loss stayed non-finite).

    Each start returns the best point it has seen (`best_points`): when its
    last iterate is worse, the message says so and `converged` is False (the
    stopping rule held, if at all, at the last iterate, not at the point
    returned)."""
    _, f_all, regressed = best_points(out["carry"])
    best = int(np.argmin(np.where(np.isfinite(f_all), f_all, np.inf)))
    statuses = [s[best] for s in out["record"]["statuses"]]
    final = statuses[-1] if statuses else NONFINITE
    phases = setup.phases
    converged = (
        out["stop_reason"] is None
        and final in (GRADIENT, LOSS)
        and len(statuses) == len(phases)
        and not regressed[best]
    )
    if out["stop_reason"] is not None:
        message = out["stop_reason"]
    elif final == NONFINITE:
        died = statuses.index(NONFINITE)
        message = (
            f"stopped: the loss or its gradient stayed non-finite for "
            f"{setup.options.max_retreats} retreats in a row (phase {died + 1}: "
            f"{phases[died].method}); returning the last good state"
        )
        # attributed to calibrate's caller
        warnings.warn(message, RuntimeWarning, stacklevel=3)
    elif final in (GRADIENT, LOSS):
        message = STATUS[final]
    else:
        message = "stopped: iteration limit of the last phase reached"
    if regressed[best]:
        message = f"{message}; {_regression(out, best, float(f_all[best]))}"
    return dict(best_start=best, converged=bool(converged), message=message)


def best_points(carry: Carry) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`(x, f, regressed)` per start: the last iterate, unless it is worse than
    the best point seen (by more than `REGRESSION_RTOL`, or not finite), which
    then replaces it (`regressed` True). A run that ends at its best point
    keeps its last iterate exactly."""
    x, f = np.asarray(carry.x), np.asarray(carry.f)
    bx, bf = np.asarray(carry.best_x), np.asarray(carry.best_f)
    regressed = np.isfinite(bf) & ~(f <= bf + REGRESSION_RTOL * np.maximum(1, abs(bf)))
    x = np.where(regressed[:, None], bx, x)
    return x, np.where(regressed, bf, f), regressed


def _regression(out: dict, start: int, best_f: float) -> str:
    """What the message says when a start's last iterate is worse than the
    best point it saw (which is returned)."""
    record = out["record"]
    last = float(np.asarray(out["carry"].f)[start])
    initial = float(np.asarray(record["initial_loss"])[start])
    hist = np.asarray(record["history"]["loss"][start])
    hits = np.flatnonzero(hist == best_f)
    iteration = 0 if best_f == initial or not hits.size else int(hits[0]) + 1
    if not last <= initial:
        return (
            f"stopped worse than the start (loss {last:.6g} > {initial:.6g} at the "
            f"start); returned the best point seen (iteration {iteration}, loss "
            f"{best_f:.6g})"
        )
    return (
        f"the last iterate (loss {last:.6g}) is worse than the best point seen "
        f"(loss {best_f:.6g} at iteration {iteration}), which is returned"
    )


def _timing(wall: float, optimize_s: float, record: dict) -> dict[str, float]:
    """`wall_s` (the whole call, to now), `optimize_s` (this call's phases) and
    `optimize_total_s` (theirs over resumed runs too)."""
    return {
        "wall_s": time.perf_counter() - wall,
        "optimize_s": optimize_s,
        "optimize_total_s": float(record["elapsed"]),
    }


def _uncertainty(setup: FitSetup, x_best, data, jac, loss: float):
    """The Laplace covariance of the free vector (None without uncertainty)
    and the result's `uncertainty` record."""
    if setup.uncertainty == "none":
        return None, {"method": "none", "level": setup.level, "message": setup.skipped}
    lap = laplace(
        setup.objective,
        x_best,
        data,
        method=setup.uncertainty,
        noise=setup.config.noise or "auto",
        jacobian=jac,
        loss=loss,
    )
    return lap.covariance, {
        "method": lap.method,
        "level": setup.level,
        "noise_variance": lap.noise_variance,
        "message": lap.message,
    }


def _fit_result(setup: FitSetup, out: dict, best: int, xs, data):
    """The `FitResult` fields that come from the run at its best start, and
    the output program's numbers (`fit_numbers`)."""
    problem, free = setup.problem, setup.free
    record = out["record"]
    x_all, f_all, _ = best_points(out["carry"])
    f_all = np.asarray(f_all, np.float64)
    x_best = jax.device_put(np.asarray(x_all[best], xs.dtype))
    sol, jac = gauss_newton_solve(setup, x_best, xs, data)
    cov, unc = _uncertainty(setup, x_best, data, jac, float(f_all[best]))
    numbers = fit_numbers(
        setup.objective, x_best, data, cov, setup.level, None if sol is None else sol.ys
    )
    if sol is None:
        sol = numbers.solution
        check_solve(sol)
    fitted = numbers.params
    trajectories = trajectory_dataset(problem, fitted, sol, numbers=numbers.trajectory)
    table = table_rows(setup.objective, numbers.table, cov, level=setup.level)
    if note := interval_note(table):
        unc["message"] = "; ".join(m for m in (unc.get("message"), note) if m)
    hist = record["history"]
    return dict(
        params=fitted,
        values=numbers.values,
        table=table,
        loss=float(f_all[best]),
        iterations=int(record["iteration"]),
        loss_history=hist["loss"][best],
        grad_norm_history=hist["grad_norm"][best],
        step_history=hist["step"][best],
        phase_history=hist["phase"][best].astype(np.int64),
        labels=free.labels,
        x=np.asarray(x_best),
        covariance=cov,
        **coefficients(problem, fitted),
        start_losses=f_all,
        initial_losses=np.asarray(record["initial_loss"]),
        uncertainty=unc,
        solver_stats={k: int(np.asarray(v)) for k, v in sol.stats.items()},
        **fit_information(setup.objective, numbers.log_likelihood),
        trajectories=trajectories,
        problem=problem,
        model_text=_model_text(problem),
        fit_config=dict(setup.config.raw),
        hashes=problem.hashes(),
        versions=library_versions(),
    ), numbers


def _model_text(problem: Problem) -> str:
    """The model file's text as its bytes (no newline translation: its SHA-256
    is the `model_sha256` that `FIT.nc` stores and checks on reading)."""
    path = problem.model_path
    if not path or not Path(path).is_file():
        return ""
    return Path(path).read_bytes().decode("utf-8", errors="replace")


def _numeric(settings: dict) -> dict:
    """The settings that change the numbers (not budgets or bookkeeping)."""
    drop = {"max_iterations"}
    return {k: v for k, v in settings.items() if k not in drop}
