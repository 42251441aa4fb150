"""`forecast`: scenarios x parameter samples of a fitted model, summarised."""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import xarray as xr

from epifit._flat import ravel
from epifit._paths import file_sha256
from epifit.data import FEATURE
from epifit.fitting import FitResult, problem_labels
from epifit.forecasting._bind import BoundScenarios, bind_scenarios
from epifit.forecasting._ensemble import (
    EnsembleConfig,
    draw_samples,
    iter_ensemble,
    param_template,
)
from epifit.forecasting._forecast_checks import _check_numbers, _horizon
from epifit.forecasting._horizon import Horizon
from epifit.forecasting._output import KIND, forecast_dataset, forecast_summary
from epifit.forecasting._posterior_draws import (
    is_posterior,
    posterior_draws,
    posterior_fit,
)
from epifit.forecasting._predictive import (
    NoisePlan,
    label_bands,
    noise_plan,
)
from epifit.forecasting._reported import check_reported
from epifit.forecasting._scenario import ScenarioSet, ScenariosLike, as_scenarios
from epifit.forecasting._settings import settings_attrs, solver_settings
from epifit.forecasting._summary import finite_samples, summarize
from epifit.model import has_reproduction_number
from epifit.ode import AbstractSolver, AbstractStepSizeController
from epifit.simulation import Problem

__all__ = [
    "DEFAULT_QUANTILES",
    "KIND",
    "PreparedForecast",
    "forecast",
    "forecast_summary",
    "prepare_forecast",
]

DEFAULT_QUANTILES = (0.025, 0.25, 0.5, 0.75, 0.975)


def _resolve_fit(fit, params, covariance, data, prov: dict[str, Any]):
    """`(problem, params, covariance, settings, provenance)` from what was given
    (`prov`: what is known already of where the fit came from)."""
    prov = dict(prov)
    if isinstance(fit, str | os.PathLike):
        path = Path(fit)
        if not path.exists():
            raise FileNotFoundError(f"Fit file {path} does not exist.")
        prov = {"fit_file": str(path), "fit_sha256": file_sha256(path)}
        fit = FitResult.from_netcdf(path, data=data)
    elif data is not None and not isinstance(fit, Problem):
        raise ValueError("data= applies to a fit file path; a FitResult has its data.")
    if isinstance(fit, FitResult):
        if params is not None or covariance is not None:
            raise ValueError(
                "params= and covariance= apply to a Problem; a FitResult has its own."
            )
        if fit.problem is None:
            where = prov.get("fit_file", "the fit")
            raise FileNotFoundError(
                f"{where} is not bound to its data (the data file it names is "
                "missing or changed); a forecast needs the covariates: pass the "
                "dataset (data=..., or --data DATA.nc)."
            )
        prov.update({k: v for k, v in fit.hashes.items() if v})
        method = fit.uncertainty.get("method", "none")
        has_cov = fit.covariance is not None
        prov["covariance"] = f"laplace ({method})" if has_cov else "none"
        return fit.problem, fit.params, fit.covariance, dict(fit.settings), prov, fit
    if isinstance(fit, Problem):
        params = fit.init_params() if params is None else params
        prov.update({k: v for k, v in fit.hashes().items() if v})
        prov["covariance"] = "given" if covariance is not None else "none"
        return fit, params, covariance, {}, prov, None
    raise TypeError(
        "fit must be a FitResult, a FIT.nc path, a Problem (with params=) or a "
        f"posterior (POSTERIOR.nc, Posterior); got {type(fit).__name__}."
    )


@dataclasses.dataclass
class PreparedForecast:
    """A forecast checked and set up, ready to run (see [`prepare_forecast`][]).

    Attributes:
        problem, bound, horizon: the problem, the bound scenarios, the days.
        quantiles: the levels.
        config: the ensemble's static configuration.
        xs: `(1 + samples, free)`: the point estimate, then the draws.
        template: the `(free, rest)` parameter arrays.
        samples: the number of draws.
        observations, compartments: the series reported.
        attrs: provenance attributes.
        noise: the observation noise of the observed series.
        seed: the forecast's seed (of the draws and of the noise).
    """

    problem: Problem
    bound: BoundScenarios
    horizon: Horizon
    quantiles: np.ndarray
    config: EnsembleConfig
    xs: np.ndarray
    template: Any
    samples: int
    observations: tuple[str, ...]
    compartments: tuple[str, ...]
    attrs: dict[str, Any]
    noise: NoisePlan
    seed: int

    def scenario_data(self) -> Iterator[dict[str, Any]]:
        """Each scenario's data, made when needed (bounded memory)."""
        initial = {k: np.asarray(v) for k, v in self.problem.initial_data.items()}
        for i in range(len(self.bound.names)):
            yield {**self.bound.data(i), "initial": initial, **self.horizon.calendar}

    def run(self, *, chunk_size: int | None = None) -> xr.Dataset:
        """Run the ensemble and summarise it (what [`forecast`][] returns)."""
        runs = iter_ensemble(
            self.config,
            self.xs,
            self.template,
            self.scenario_data(),
            chunk_size=chunk_size,
        )
        return self.summarize(runs)

    def summarize(self, runs: Iterable) -> xr.Dataset:
        """The Dataset from [`run_ensemble`][]'s output (or
        [`iter_ensemble`][]'s, consumed one scenario at a time)."""
        cfg, samples, q = self.config, self.samples, self.quantiles
        observations, compartments = self.observations, self.compartments
        n_fit = self.horizon.n_fit
        bound = self.bound
        series_names = (*observations, *compartments, *cfg.levels, *cfg.derived)
        keys = {"first_rows": cfg.first_rows, "derived": cfg.derived}
        per_scenario, estimates, failed = [], [], []
        theta = self.noise.parameters(cfg, self.xs, self.template)
        index = {o.name: i for i, o in enumerate(cfg.model.spec.observations)}
        for name, (series, results) in zip(bound.names, runs, strict=True):
            finite = finite_samples(series, **keys)
            ok = (results == 0) & finite
            if not ok[0]:
                raise RuntimeError(
                    f"The solve at the point estimate failed in scenario '{name}' "
                    f"(result code {int(results[0])}); give more max_steps or other "
                    "solver tolerances, or check the scenario's changes."
                )
            estimates.append({s: series[s][0] for s in series})
            use = ok[1:] if samples else ok[:1]
            pick = slice(1, None) if samples else slice(0, 1)
            chosen = {
                s: series[s][pick] if use.all() else series[s][pick][use]
                for s in series
            }
            rows = np.arange(len(self.xs))[pick]
            rows = rows if use.all() else rows[use]
            chosen = self.noise.add_noise(
                chosen,
                {n: {k: v[rows] for k, v in d.items()} for n, d in theta.items()},
                seed=self.seed,
                index=index,
            )
            failed.append(int(np.sum(~ok[1:])))
            if samples and not np.any(use):
                warnings.warn(
                    f"Every parameter draw failed to solve in scenario '{name}'; its "
                    "quantiles are NaN.",
                    RuntimeWarning,
                    stacklevel=2,
                )
            per_scenario.append(summarize(chosen, quantiles=q, start=n_fit, **keys))
        ds = forecast_dataset(
            problem=self.problem,
            bound=bound,
            horizon=self.horizon,
            quantiles=q,
            per_scenario=per_scenario,
            estimates=estimates,
            failed=failed,
            series_names=series_names,
            observations=observations,
            attrs=self.attrs,
            levels=cfg.levels,
            derived=cfg.derived,
        )
        kinds = {s: "observed" if s in observations else "" for s in series_names}
        return label_bands(ds, self.noise.bands(kinds, samples))


def prepare_forecast(
    fit: FitResult | str | os.PathLike | Problem | Any,
    scenarios: ScenariosLike = (),
    *,
    days: int | None = None,
    samples: int = 100,
    seed: int = 0,
    quantiles: Sequence[float] = DEFAULT_QUANTILES,
    compartments: Sequence[str] = (),
    data: xr.Dataset | str | os.PathLike | None = None,
    params=None,
    covariance: np.ndarray | None = None,
    baseline: bool = True,
    solver: AbstractSolver | None = None,
    stepsize_controller: AbstractStepSizeController | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    max_steps: int | None = None,
    observation_noise: bool = True,
    posterior=None,
) -> PreparedForecast:
    """Check a forecast's inputs, bind its scenarios and draw its samples,
    without running anything: `prepare_forecast(...).run()` is
    [`forecast`][]. The arguments are those of `forecast` (less
    `chunk_size`)."""
    fit, posterior, data, known = _own_fit(fit, posterior, data)
    problem, params, cov, stored, prov, fit_obj = _resolve_fit(
        fit, params, covariance, data, known
    )
    sset = as_scenarios(scenarios) if not _empty(scenarios) else ScenarioSet(())
    days = sset.days if days is None else days
    if days is None:
        raise ValueError(
            "Give the forecast horizon: days=N (--days N), or `days = N` in the "
            "scenario file."
        )
    q = _check_numbers(days, samples, seed, quantiles)
    model = problem.model
    noise = noise_plan(model, observation_noise)
    observations = tuple(o.name for o in model.spec.observations)
    compartments = check_reported(model, tuple(compartments), observations)
    n_series = len(observations + compartments + tuple(model.spec.series))
    n_series += has_reproduction_number(model)  # R_eff and R_eff_total
    horizon = _horizon(problem, days, samples, n_series, len(noise.noisy))
    bound = _bind(problem, params, sset, horizon, baseline)
    template, static = param_template(model, params)
    xs, drawn = _draws(problem, template, fit_obj, cov, samples, seed, posterior)
    settings = solver_settings(
        stored, solver, stepsize_controller, rtol, atol, max_steps
    )
    controller = settings.controller
    sha = file_sha256(sset.source) if sset.source else None
    cfg = EnsembleConfig(
        model=model,
        n_patches=problem.n_cells,
        n_days=horizon.n_days,
        interval_of_day=tuple(int(v) for v in bound.interval_of_day),
        parameters=bound.parameters,
        transmission=bound.transmission,
        observations=observations,
        compartments=compartments,
        solver=settings.solver,
        controller=controller,
        max_steps=settings.max_steps,
        dtype=str(np.dtype(problem.dtype)),
        static=static,
    )
    attrs = {
        **prov,
        "samples": int(samples),
        "seed": int(seed),
        **settings_attrs(settings.solver, controller, settings.max_steps),
        **noise.attrs(),
        **drawn,
        "scenarios_file": sset.source or "",
        **({"scenarios_sha256": sha} if sha else {}),
    }
    return PreparedForecast(
        problem=problem,
        bound=bound,
        horizon=horizon,
        quantiles=q,
        config=cfg,
        xs=xs,
        template=template,
        samples=int(samples),
        observations=observations,
        compartments=compartments,
        attrs=attrs,
        noise=noise,
        seed=int(seed),
    )


def _own_fit(fit, posterior, data):
    """`(fit, posterior, data, provenance)`: a posterior given as `fit` (a
    `POSTERIOR.nc`, found by its groups, or a `Posterior` or InferenceData)
    forecasts from its own draws with the fit it embeds (bound to `data`);
    anything else is passed on as it came."""
    if isinstance(fit, FitResult | Problem) or not is_posterior(fit):
        return fit, posterior, data, {}
    if posterior is not None:
        where = f"'{fit}'" if isinstance(fit, str | os.PathLike) else "fit"
        raise ValueError(
            f"{where} is a posterior (epifit sample) and forecasts from its own "
            "draws; posterior= (--posterior) goes with a FIT.nc: drop it"
        )
    own, prov = posterior_fit(fit, data)
    return own, fit, None, prov


def _bind(problem: Problem, params, sset, horizon, baseline) -> BoundScenarios:
    """The scenarios bound to the problem's model and data (with the feature
    labels of the dataset, when it has them)."""
    model = problem.model
    values = jax.tree.map(np.asarray, model.constrain(params))
    # a time-varying parameter's change is checked at its last fitted value
    values |= {k: np.asarray(v[-1]) for k, v in model.daily_values(params).items()}
    feature_labels = {}
    ds_in = problem.dataset
    if ds_in is not None and FEATURE in ds_in.coords:
        labels = [str(v) for v in ds_in[FEATURE].values]
        feature_labels = {
            c.name: labels for c in model.spec.covariates if FEATURE in c.dims
        }
    bound = bind_scenarios(
        sset,
        model=model,
        patches=problem.patches,
        covariates=dict(problem.covariates),
        values=values,
        horizon=horizon,
        feature_labels=feature_labels,
        baseline=baseline,
    )
    if not bound.names:
        raise ValueError("No scenarios to run: give scenarios, or baseline=True.")
    return bound


def _draws(problem: Problem, template, fit_obj, cov, samples, seed, posterior):
    """`(1 + samples, free)`: the point estimate, then the draws (checked
    against the fit's parameter labels, for a fit): from `posterior` (a
    sample of `epifit sample`) when given, else from the Laplace
    approximation; and the attributes saying which."""
    x_hat = np.asarray(ravel(template[0])[0], np.float64)
    labels, _ = problem_labels(problem, template[0])
    if fit_obj is not None and tuple(labels) != tuple(fit_obj.labels):
        raise ValueError(
            "The fit's free parameters do not match its model's: "
            f"{list(fit_obj.labels)[:8]} vs {labels[:8]}."
        )
    if posterior is not None:
        draws, attrs = posterior_draws(
            posterior, tuple(labels), int(samples), seed, x_hat
        )
    else:
        cov = cov if samples else None
        draws = draw_samples(x_hat, cov, int(samples), seed=int(seed))
        attrs = {"draws_from": "laplace" if samples else "none"}
    return np.concatenate([x_hat[None, :], draws.astype(x_hat.dtype)]), attrs


def forecast(
    fit: FitResult | str | os.PathLike | Problem | Any,
    scenarios: ScenariosLike = (),
    *,
    days: int | None = None,
    samples: int = 100,
    seed: int = 0,
    quantiles: Sequence[float] = DEFAULT_QUANTILES,
    compartments: Sequence[str] = (),
    data: xr.Dataset | str | os.PathLike | None = None,
    params=None,
    covariance: np.ndarray | None = None,
    baseline: bool = True,
    solver: AbstractSolver | None = None,
    stepsize_controller: AbstractStepSizeController | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    max_steps: int | None = None,
    chunk_size: int | None = None,
    observation_noise: bool = True,
    posterior=None,
) -> xr.Dataset:
    """Run scenarios over the uncertainty of a fitted model.

    Every scenario runs from day 0 of the data to `days` days past its end,
    for the point estimate and `samples` draws of the free parameters from the
    fit's Laplace approximation (`Normal(x̂, covariance)` in unconstrained
    coordinates), or from a posterior sample; a `baseline` scenario carries
    the last observed covariates forward. The draws are shared by all
    scenarios, so differences between scenarios are not blurred by sampling
    noise.

    Args:
        fit: a [`FitResult`][epifit.FitResult], a `FIT.nc` path, or a
            [`Problem`][epifit.Problem] with `params` (and `covariance` for
            draws): a model bound to data without a fit. Or a posterior of
            [`sample`][epifit.sample] (a `POSTERIOR.nc` path, told from a
            `FIT.nc` by its `posterior` group, a
            [`Posterior`][epifit.Posterior] or its `arviz.InferenceData`):
            its draws with the fit it embeds (its `fit` group: the model,
            data file, fit configuration and point estimate), the same
            forecast as `forecast(FIT.nc, posterior=POSTERIOR.nc)`; the data
            file is found by its SHA-256 (its absolute path, then relative to
            the posterior file's folder, then to the working directory) or
            given as `data`.
        scenarios: a `SCENARIOS.toml` path, the same as a mapping, one
            [`Scenario`][epifit.forecasting.Scenario] or a list of them
            (default: the baseline only).
        days: forecast days past the data (default: the scenario file's).
        samples: parameter draws (0: the point estimate only; every quantile
            is then the point trajectory).
        seed: seeds the draws.
        quantiles: the levels to report.
        compartments: compartments to report besides the observed series
            (summed over stages).
        data: the dataset, for a `FIT.nc` (or `POSTERIOR.nc`) whose data
            file moved.
        params: with a `Problem`: unconstrained parameters (default: the
            model's initial values).
        covariance: with a `Problem`: the covariance of the free
            unconstrained vector (in `ravel_pytree` order of the free
            parameters, as `FitResult.labels`).
        baseline: include the `baseline` scenario first.
        solver, stepsize_controller, rtol, atol, max_steps: the solve
            (default: the fit's settings, Tsit5 with rtol 1e-6, atol 1e-9).
        chunk_size: samples per compiled call (default: by memory and, on
            CPU, by state size; see `epifit.forecasting.default_chunk`).
        observation_noise: the observed series' quantiles are over the draws
            and each family's noise around them (at least `NOISE_SAMPLES`
            noisy samples), the band new data fall in; False: the expected
            observations only. Each quantile variable's `bands` says which.
        posterior: draws from `epifit.sample`'s posterior (a `POSTERIOR.nc`
            path, a `Posterior` or an `arviz.InferenceData`) in place of the
            Laplace approximation's; not with a posterior as `fit`.

    Returns:
        A Dataset with, for every observed series and chosen compartment `s`:
        `s (scenario, quantile, time, patch)`, `s_total (scenario, quantile,
        time)` (sum over patches), `estimate_s (scenario, time, patch)` (at the
        point estimate); `peak_day_s`, `peak_s` (over the whole horizon) and
        `cumulative_s` (over the forecast days) `(scenario, quantile, patch)`
        with `_total` twins `(scenario, quantile)`; `observed_<name> (time,
        patch)` for context; `failed_samples (scenario)`; with infections
        `R_eff`, `R_eff_total` and their `estimate_` twins (quantiles only);
        every derived series `d` as `d` and `estimate_d` (no statistics);
        provenance attributes (`epifit_kind = "forecast"`, fit file and hash,
        seed, versions, the scenarios as JSON). Incidence has no value on day
        0; a model with `[strata]` has `(patch, STRATUM)` in place of `patch`.

    Raises:
        ScenarioError: a scenario that does not fit the model, data or horizon.
        ValueError: bad arguments, or draws without a usable covariance; a
            posterior as `fit` that embeds no fit, or with `posterior=`.
        FileNotFoundError: a fit file that is missing or not bound to its data.
        RuntimeError: the solve at the point estimate fails in a scenario.
    """
    given = dict(locals())  # the arguments: prepare_forecast's and chunk_size
    chunk_size = given.pop("chunk_size")
    return prepare_forecast(**given).run(chunk_size=chunk_size)


def _empty(scenarios) -> bool:
    return isinstance(scenarios, tuple | list) and len(scenarios) == 0
