"""A forecast as an xarray Dataset, and its JSON digest."""

from __future__ import annotations

import datetime as _dt
import json
from typing import Any

import numpy as np
import xarray as xr

from epifit.data import PATCH, QUANTILE, SCENARIO, TIME
from epifit.fitting import library_versions
from epifit.forecasting._strata import forecast_on_cells

__all__ = ["KIND", "STATISTICS", "forecast_dataset", "forecast_summary"]

KIND = "forecast"
STATISTICS = ("peak_day", "peak", "cumulative")
_STATISTIC_NAMES = {
    "peak_day": "day of the peak (days since the first day)",
    "peak": "peak value over the horizon",
    "cumulative": "sum over the forecast days",
}


def forecast_dataset(
    *,
    problem,
    bound,
    horizon,
    quantiles,
    per_scenario,
    estimates,
    failed,
    series_names,
    observations,
    attrs,
    levels=(),
    derived=(),
) -> xr.Dataset:
    T = horizon.n_days
    time = horizon.dates if horizon.dates is not None else np.arange(T)
    coords = {
        SCENARIO: list(bound.names),
        "scenario_description": (SCENARIO, list(bound.descriptions)),
        QUANTILE: quantiles,
        TIME: time,
        "day": (TIME, np.arange(T)),
        PATCH: list(problem.patches),
    }
    data_vars: dict[str, Any] = {}
    units = "as the model's series (counts, or fractions of each patch)"
    for s in series_names:
        if s in levels:
            data_vars.update(_level_vars(s, per_scenario, estimates))
            continue
        if s in derived:
            data_vars.update(_derived_vars(problem.spec, s, per_scenario, estimates))
            continue
        kind = "observed series" if s in observations else "compartment (all stages)"
        data_vars[s] = (
            (SCENARIO, QUANTILE, TIME, PATCH),
            np.stack([p[s] for p in per_scenario]),
            {"long_name": f"quantiles of {kind} '{s}'", "units": units},
        )
        data_vars[f"{s}_total"] = (
            (SCENARIO, QUANTILE, TIME),
            np.stack([p[f"{s}_total"] for p in per_scenario]),
            {"long_name": f"quantiles of '{s}' summed over patches"},
        )
        data_vars[f"estimate_{s}"] = (
            (SCENARIO, TIME, PATCH),
            np.stack([e[s] for e in estimates]),
            {"long_name": f"'{s}' at the point estimate"},
        )
        for stat in STATISTICS:
            what = _STATISTIC_NAMES[stat]
            data_vars[f"{stat}_{s}"] = (
                (SCENARIO, QUANTILE, PATCH),
                np.stack([p[f"{stat}_{s}"] for p in per_scenario]),
                {"long_name": f"quantiles of the {what} of '{s}'"},
            )
            data_vars[f"{stat}_{s}_total"] = (
                (SCENARIO, QUANTILE),
                np.stack([p[f"{stat}_{s}_total"] for p in per_scenario]),
                {"long_name": f"quantiles of the {what} of '{s}' summed over patches"},
            )
    data_vars.update(_observed_vars(problem, T))
    data_vars["failed_samples"] = (
        SCENARIO,
        np.asarray(failed, np.int64),
        {"long_name": "parameter draws whose solve failed (left out)"},
    )
    start_label = (
        str(np.datetime_as_string(horizon.dates[horizon.n_fit], unit="D"))
        if horizon.dates is not None and horizon.n_fit < T
        else str(horizon.n_fit)
    )
    spec = problem.spec
    full_attrs = {
        "title": f"epifit forecast of model '{spec.name}'",
        "epifit_kind": KIND,
        "model": spec.name,
        "model_file": str(problem.model_path or ""),
        "data_file": str(problem.data_path or ""),
        "days": int(T - horizon.n_fit),
        "n_fit_days": int(horizon.n_fit),
        "forecast_start": start_label,
        "forecast_start_day": int(horizon.n_fit),
        "series": json.dumps(list(series_names)),
        "observations": json.dumps(list(observations)),
        "derived_series": json.dumps(list(derived)),
        "scenarios": json.dumps(bound.definitions),
        "baseline_rule": "the last observed day's covariates carried forward",
        "time_units": "days since the first date",
        **attrs,
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        **{f"version_{k}": v for k, v in library_versions().items()},
    }
    return forecast_on_cells(problem, data_vars, coords, full_attrs)


def _observed_vars(problem, n_days: int) -> dict[str, Any]:
    """`observed_<name> (time, patch)`: the data on the forecast's days (NaN
    past the fit window and where masked), for context."""
    out = {}
    for name, obs in problem.observed.items():
        o = np.where(np.asarray(problem.mask[name]), np.asarray(obs, float), np.nan)
        days = problem.stamps[name].days
        inside = days < n_days
        full = np.full((n_days, o.shape[1]), np.nan)
        full[days[inside]] = o[inside]
        out[f"observed_{name}"] = (
            (TIME, PATCH),
            full,
            {"long_name": f"observed '{name}' (the fit window)"},
        )
    return out


def _level_vars(s: str, per_scenario, estimates) -> dict[str, Any]:
    """The quantiles and point estimates of the reproduction number `s`
    (`R_eff`): per patch, and its `_total` over all patches (the spectral
    radius, not a sum; see `docs/models.md`, "The reproduction number")."""
    what = "the effective reproduction number"
    return {
        s: (
            (SCENARIO, QUANTILE, TIME, PATCH),
            np.stack([p[s] for p in per_scenario]),
            {
                "long_name": f"quantiles of {what} of a new infection in the patch",
                "units": "1",
            },
        ),
        f"{s}_total": (
            (SCENARIO, QUANTILE, TIME),
            np.stack([p[f"{s}_total"] for p in per_scenario]),
            {"long_name": f"quantiles of {what} over all patches", "units": "1"},
        ),
        f"estimate_{s}": (
            (SCENARIO, TIME, PATCH),
            np.stack([e[s] for e in estimates]),
            {"long_name": f"{what} at the point estimate", "units": "1"},
        ),
        f"estimate_{s}_total": (
            (SCENARIO, TIME),
            np.stack([e[f"{s}_total"][:, 0] for e in estimates]),
            {
                "long_name": f"{what} over all patches at the point estimate",
                "units": "1",
            },
        ),
    }


def _derived_vars(spec, s: str, per_scenario, estimates) -> dict[str, Any]:
    """The quantiles and point estimate of derived series `s` (`[derived]`
    reading the state or covariates), per patch only, its expression in
    `long_name` as `epifit simulate` and FIT.nc write it (no units: those
    of the expression)."""
    source = {d.name: d.expression.source for d in spec.series}[s]
    what = f"derived series {s} = {source}"
    return {
        s: (
            (SCENARIO, QUANTILE, TIME, PATCH),
            np.stack([p[s] for p in per_scenario]),
            {"long_name": f"quantiles of {what}"},
        ),
        f"estimate_{s}": (
            (SCENARIO, TIME, PATCH),
            np.stack([e[s] for e in estimates]),
            {"long_name": f"{what} at the point estimate"},
        ),
    }


def forecast_summary(ds: xr.Dataset) -> dict[str, Any]:
    """A JSON-ready digest of a forecast: per scenario and observed series,
    the quantiles of the totals over patches (cumulative over the forecast
    days, peak and peak day), and the failed draws."""
    if ds.attrs.get("epifit_kind") != KIND:
        raise ValueError("Not an epifit forecast (epifit_kind != 'forecast').")
    series = json.loads(ds.attrs.get("observations", "[]"))
    levels = [float(v) for v in ds[QUANTILE].values]
    key = lambda v: f"{v:g}"  # noqa: E731
    out: dict[str, Any] = {
        "model": ds.attrs.get("model"),
        "samples": int(ds.attrs.get("samples", 0)),
        "seed": int(ds.attrs.get("seed", 0)),
        "days": int(ds.attrs.get("days", 0)),
        "forecast_start": ds.attrs.get("forecast_start"),
        "quantiles": levels,
        "observation_noise": json.loads(ds.attrs.get("observation_noise", "{}")),
        "scenarios": {},
    }
    for name in ds[SCENARIO].values:
        rec: dict[str, Any] = {
            "failed_samples": int(ds["failed_samples"].sel({SCENARIO: name}))
        }
        for s in series:
            rec[s] = {
                stat: {
                    key(lv): float(v)
                    for lv, v in zip(
                        levels,
                        ds[f"{stat}_{s}_total"].sel({SCENARIO: name}).values,
                        strict=True,
                    )
                }
                for stat in STATISTICS
            }
        out["scenarios"][str(name)] = rec
    return out
