"""`sample`: NUTS over a fit's free parameters, from its MAP."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from epifit.fitting import FitResult, calibrate, fit_config, resolve_fit
from epifit.sampling._chains import (
    resolve_chain_method,
    run_sequential,
    run_threads,
    run_vectorized,
)
from epifit.sampling._checkpoint import chain_checkpoint
from epifit.sampling._density import LogDensity, Whitened, whitening
from epifit.sampling._nuts import (
    NutsSettings,
    Programs,
    initial_inverse_mass,
    start_points,
)
from epifit.sampling._posterior import Posterior, posterior_data
from epifit.sampling._processes import run_processes
from epifit.simulation import Problem

__all__ = ["sample"]


def sample(
    model_or_problem=None,
    data=None,
    *,
    fit: str | os.PathLike | Mapping[str, Any] | None = None,
    init: FitResult | str | os.PathLike | None = None,
    values: Mapping[str, Any] | None = None,
    chains: int = 4,
    warmup: int = 500,
    draws: int = 1000,
    seed: int = 0,
    mass_matrix: str = "diagonal",
    target_accept: float = 0.8,
    max_tree_depth: int = 10,
    chunk: int = 50,
    chain_method: str | None = None,
    workers: int | None = None,
    checkpoint: str | os.PathLike | None = None,
    resume: bool = False,
    progress: bool | str = "auto",
    whiten: bool | None = None,
) -> Posterior:
    """Posterior draws of a model's free parameters by NUTS (blackjax).

    The log posterior is calibrate's objective, negated (the observations'
    log-likelihood plus the fit configuration's log-priors), on the
    unconstrained free vector, plus the log-Jacobian of each prior'd
    parameter's transform (a prior is a density of the constrained value). Each
    chain adapts its step size and mass matrix by Stan's window adaptation
    (`warmup` iterations; blackjax's dual averaging and Welford windows, in the
    same compiled program as the draws), then draws `draws` samples. Chains
    start from draws of the Laplace approximation at the MAP (which `init`, a
    `FitResult` or `FIT.nc`, gives; else `calibrate` finds it first), a draw
    where the log density is not finite, or far below the MAP's (by more than a
    Gaussian posterior's own Laplace draws fall with probability 1e-8), pulled
    towards the MAP until it is not; the chains move on the Laplace
    approximation's whitened coordinates (`whiten`), or, without it, the
    Laplace covariance (its diagonal for `mass_matrix="diagonal"`) seeds the
    mass matrix. A chain's draws depend on `seed`, the chain and the draw's
    index alone: not on `chain_method` (but for rounding), `chunk` or an
    interruption and resume.

    Args:
        model_or_problem, data, fit: as for `calibrate` (a `Problem`, or a
            model and its data; `fit` a `FIT.toml`, its priors and solver
            settings used here too). With `init` a `FitResult` bound to its
            data, neither is needed.
        values: start from these constrained values (as `calibrate`'s
            `values`; `{}`: the model's) instead of a MAP: no calibrate run,
            no Laplace approximation (starts 0.1 apart in each unconstrained
            coordinate, an identity first mass matrix), no embedded fit.
        chains, warmup, draws: the sampler's size.
        seed: the seed of the starts, the warm-up and every draw.
        mass_matrix: `diagonal` or `dense`.
        target_accept: the warm-up's target acceptance rate.
        max_tree_depth: NUTS' maximum number of trajectory doublings.
        chunk: draws per compiled call (a checkpoint and a progress step each).
        chain_method: `sequential` (one after another, in this process),
            `threads` (`workers` chains at a time in threads of this
            process, one compiled program: the default on a CPU with more
            than one core), `vectorized` (every chain in one vmapped
            program, in lockstep; the default on a GPU or TPU) or
            `processes` (spawned single-threaded CPU workers, each compiling
            its own program). `sequential`, `threads` and `processes` give
            the same draws bit for bit.
        workers: with `threads` or `processes`, how many chains run at once
            (default one per core; never more than `chains`).
        checkpoint: a file the chains are saved to atomically after the
            warm-up and every chunk; `resume=True` continues from it.
        progress: a progress bar per chain on stderr (its warm-up, then its
            draws).
        whiten: sample the whitened coordinates `z` of the Laplace
            approximation, `x = x_map + root @ z` (`root @ root.T` its
            covariance), with an identity first mass matrix: `None` (the
            default) where the start has a positive definite covariance,
            `True` to insist, `False` never (see `Whitened` for why).

    Returns:
        A [`Posterior`][epifit.sampling.Posterior] (its `.data` an
        `arviz.InferenceData`; its `.fit` the MAP fit the chains started
        from, which the InferenceData's `fit` group holds as `FIT.nc` does,
        so that the posterior file alone can be forecast).
    """
    wall = time.perf_counter()
    settings = NutsSettings(chains=chains, warmup=warmup, draws=draws, seed=seed,
                            mass_matrix=mass_matrix, target_accept=target_accept,
                            max_tree_depth=max_tree_depth, chunk=chunk)  # fmt: skip
    method, n_workers = resolve_chain_method(chain_method, workers, chains)
    if whiten is not None and not isinstance(whiten, bool):
        raise ValueError(f"whiten must be True, False or None; got {whiten!r}")
    start = (_map if values is None else _given)(model_or_problem, data, fit, init,
                                                 values)  # fmt: skip
    roots = _whitening(whiten, start["covariance"])
    return _sample_from(start, roots, settings, method, n_workers, checkpoint,
                        resume, progress, wall)  # fmt: skip


def _sample_from(start, roots, settings, method, n_workers, checkpoint, resume,
                 progress, wall) -> Posterior:  # fmt: skip
    """`sample` from its `start` (a MAP and its covariance, or given values)."""
    objective = start["objective"]
    data_ = objective.data()
    density = LogDensity(objective)
    x_map = np.asarray(start["x"], np.float64)
    # a start where the density is not finite, or far below the MAP's, is
    # pulled towards the MAP (`anchor`) by the chains' own program, as it
    # begins them
    starts = start_points(x_map, start["covariance"], settings)
    run_density, run_starts, keyed, imm0, anchor = _coordinates(
        roots, density, start["covariance"], x_map, starts, settings
    )
    store = chain_checkpoint(checkpoint, resume, objective, settings, keyed)
    t0 = time.perf_counter()
    with _bars(progress, settings) as bar:
        results = _run_chains(method, n_workers, run_density, settings,
                              run_starts.astype(x_map.dtype), jax.device_put(imm0),
                              anchor.astype(x_map.dtype), store, bar)  # fmt: skip
    if roots is not None:
        results = [_unwhitened(r, x_map, roots[0]) for r in results]
    sampling_s = time.perf_counter() - t0
    provenance = start["provenance"] | _method_attrs(method, n_workers)
    provenance["whitening"] = "none" if roots is None else "laplace"
    provenance["gradient"] = density.gradient
    timing = _timing(results, sampling_s, time.perf_counter() - wall)
    idata = posterior_data(density, data_, results, settings, x_map=x_map,
                           provenance=provenance, timing=timing,
                           fit=start["fit"])  # fmt: skip
    return Posterior(idata, fit=start["fit"])


def _whitening(whiten, covariance):
    """The whitening root and its inverse: the Laplace covariance's, unless
    `whiten` is False or (None) there is none that can whiten."""
    roots = None if whiten is False else whitening(covariance)
    if whiten is True and roots is None:
        raise ValueError(
            "whiten=True needs a positive definite Laplace covariance at the MAP "
            "(init or a calibrate run with uncertainty); this start has none"
        )
    return roots


def _coordinates(roots, density, covariance, x_map, starts, settings):
    """The chains' density, starts, checkpoint key, first inverse mass
    matrix and the MAP: on `x` itself, or (with whitening `roots`) on `z`,
    where `x = x_map + root @ z` (the MAP is `z = 0`)."""
    if roots is None:
        imm0 = initial_inverse_mass(covariance, x_map.size, settings)
        return density, starts, starts, imm0, x_map
    z_starts = (starts - x_map) @ roots[1].T
    keyed = np.vstack([z_starts, roots[0]])
    imm0 = initial_inverse_mass(None, x_map.size, settings)
    whitened = Whitened(density, x_map, roots[0])
    return whitened, z_starts, keyed, imm0, np.zeros_like(x_map)


def _unwhitened(result: dict, shift, root) -> dict:
    """A chain's result on `x`: its draws `shift + root @ z`, its adapted
    inverse mass matrix `root M root.T` (a diagonal `M` made dense)."""
    m = np.asarray(result["inverse_mass_matrix"], np.float64)
    m = np.diag(m) if m.ndim == 1 else m
    z = np.asarray(result["positions"], np.float64)
    return result | {
        "positions": (shift + z @ root.T).astype(np.asarray(result["positions"]).dtype),
        "inverse_mass_matrix": root @ m @ root.T,
    }


def _run_chains(method, workers, density, settings, starts, imm0, anchor, store, bar):
    """The chains' results by `method` (see `_chains.py`)."""
    if method == "processes":
        job = (density, settings, starts, imm0, anchor)
        return run_processes(*job, store, bar, workers)
    data = density.objective.data()
    programs = Programs(density, settings, anchor)
    if method == "threads":
        return run_threads(programs, starts, imm0, data, store, bar, workers)
    run = run_sequential if method == "sequential" else run_vectorized
    return run(programs, starts, imm0, data, store, bar)


def _timing(results, sampling_s: float, wall_s: float) -> dict:
    return {
        "sampling_s": sampling_s,
        "wall_s": wall_s,
        "warmup_s": [r["warmup_s"] for r in results],
        "draws_s": [r["draws_s"] for r in results],
    }


def _method_attrs(method: str, workers: int) -> dict:
    return {"chain_method": method} | (
        {"workers": workers} if method in ("threads", "processes") else {}
    )


def _problem(model_or_problem, data) -> Problem:
    if isinstance(model_or_problem, Problem):
        return model_or_problem
    if model_or_problem is None or data is None:
        raise ValueError("sample needs a model and its data, a Problem, or init")
    return Problem(model_or_problem, data)


def _given(model_or_problem, data, fit, init, values) -> dict:
    """The objective sampled, from constrained `values` (no MAP)."""
    if init is not None:
        raise ValueError("give init (a fit to start from) or values, not both")
    problem = _problem(model_or_problem, data)
    setup = resolve_fit(problem, fit_config(fit), values=values)
    hashes = problem.hashes()
    return {
        "fit": None,
        "objective": setup.objective,
        "x": setup.objective.free.x0,
        "covariance": None,
        "provenance": {k: v or "" for k, v in hashes.items()} | {"start": "values"},
    }


def _map(model_or_problem, data, fit, init, values=None) -> dict:
    """The MAP, its Laplace covariance and the objective sampled."""
    if isinstance(init, str | os.PathLike):
        init = FitResult.from_netcdf(Path(init), data=data)
    if init is not None and not isinstance(init, FitResult):
        raise TypeError(
            f"init must be a FitResult or a FIT.nc path; got {type(init).__name__}"
        )
    if init is None:
        init = calibrate(_problem(model_or_problem, data), fit=fit, progress=False)
        if fit is None:
            fit = init.fit_config
    if init.problem is None:
        raise ValueError(
            "init: the fit's data file was not found; give data=... to bind it"
        )
    config = fit_config(init.fit_config if fit is None else fit)
    setup = resolve_fit(init.problem, config, init=init.params)
    x, covariance = _conditioned(init, setup.objective.free)
    return {
        "fit": init,
        "objective": setup.objective,
        "x": x,
        "covariance": covariance,
        "provenance": {
            "model_sha256": init.hashes.get("model_sha256", ""),
            "data_sha256": init.hashes.get("data_sha256", ""),
            "map_loss": float(init.loss),
            "model_text": init.model_text,
            # the whole free vector from a MAP whose Hessian has negative
            # curvature (`Posterior.warnings` says what that means)
            "map_saddle": bool(
                init.laplace_fallback
                and tuple(setup.objective.free.labels) == tuple(init.labels)
            ),
        },
    }


def _conditioned(init: FitResult, free) -> tuple[np.ndarray, np.ndarray | None]:
    """The MAP's free vector and Laplace covariance over `free`'s entries.

    The same as the fit's when `fit` frees what it freed; when `fit` fixes
    some of them (say a neural sub-model's weights, at the MAP's values),
    the posterior sampled is conditional on those values, and so is the
    covariance: the Schur complement `S_AA - S_AB S_BB⁻¹ S_BA` of the fixed
    block `B` (the inverse of the precision's `AA` block); None where it is
    not finite and positive definite. A label `fit` frees that the MAP held
    fixed has no covariance entry: None (an identity first mass matrix)."""
    x = np.asarray(free.x0, np.float64)
    labels = tuple(init.labels)
    if tuple(free.labels) == labels:
        return np.asarray(init.x, np.float64), init.covariance
    where = {label: i for i, label in enumerate(labels)}
    if init.covariance is None or any(lab not in where for lab in free.labels):
        return x, None
    cov = np.asarray(init.covariance, np.float64)
    a = np.array([where[lab] for lab in free.labels])
    b = np.setdiff1d(np.arange(len(labels)), a)
    try:
        S = cov[np.ix_(a, a)] - cov[np.ix_(a, b)] @ np.linalg.solve(
            cov[np.ix_(b, b)], cov[np.ix_(b, a)]
        )
        S = (S + S.T) / 2
        np.linalg.cholesky(S)
    except np.linalg.LinAlgError:
        return x, None
    return x, (S if np.all(np.isfinite(S)) else None)


class _bars:
    """One rich progress bar per chain: its warm-up, then its draws.
    `bar(chain, transitions)`: the chain's transitions done (warm-up
    included)."""

    def __init__(self, progress, settings: NutsSettings):
        from epifit.fitting import progress_enabled

        self.on = progress_enabled(progress)
        self.settings = settings

    def __enter__(self):
        if not self.on:
            return lambda c, done: None
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        s = self.settings
        self.progress = Progress(
            TextColumn("chain {task.fields[chain]}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} {task.fields[phase]}"),
            TimeRemainingColumn(),
            transient=False,
        )
        self.progress.__enter__()
        first = ("warm-up", s.warmup) if s.warmup else ("draws", s.draws)
        tasks = [
            self.progress.add_task("", total=first[1], chain=c, phase=first[0])
            for c in range(s.chains)
        ]

        def bar(c: int, done: int) -> None:
            if done < s.warmup:
                self.progress.update(tasks[c], completed=done, total=s.warmup,
                                     phase="warm-up")  # fmt: skip
            else:
                draws = min(done - s.warmup, s.draws)
                self.progress.update(tasks[c], completed=draws, total=s.draws,
                                     phase="draws")  # fmt: skip

        return bar

    def __exit__(self, *exc):
        if self.on:
            self.progress.__exit__(*exc)
