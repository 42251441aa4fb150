"""Synthetic observations in a simulation's output (`simulate(observe=...)`):
a dated time axis, noisy series under the observations' own names, and the
inputs the model reads, so that the file is data for `calibrate`.

Cost: one draw per compared point (see `_noise.sample_noise`) and a copy of the
covariates and initial-state variables, linear in their size.
"""

from __future__ import annotations

import datetime as _dt
import json

import numpy as np
import xarray as xr

from epifit.data import PATCH, PATCH_TO, TIME, DataError
from epifit.simulation._noise import noise_of, observation_key, sample_noise
from epifit.simulation._problem import Problem

__all__ = ["DEFAULT_START", "add_observations", "parse_start", "set_dates"]

DEFAULT_START = "2020-01-01"
"""The first date of a simulation with observations and no dated data."""


def parse_start(start) -> np.datetime64:
    """`start` (`YYYY-MM-DD`, a `datetime.date` or a `numpy.datetime64`) as a
    day.

    Raises:
        ValueError: not a valid date, naming `--start`.
    """
    if isinstance(start, _dt.date | np.datetime64):
        return np.datetime64(start, "D")
    try:
        return np.datetime64(_dt.date.fromisoformat(str(start)), "D")
    except ValueError:
        raise ValueError(
            f"--start must be a date YYYY-MM-DD, e.g. {DEFAULT_START}; got {start!r}"
        ) from None


def set_dates(problem: Problem, start) -> None:
    """Date the problem's days from `start` (the predictions then see the
    days of the week, as a fit to the dated output will).

    Raises:
        ValueError: `start` is not a date, or the data are dated already.
    """
    first = parse_start(start)
    if problem.dates is not None:
        raise ValueError(
            f"--start {start}: the data are dated (from "
            f"{np.datetime_as_string(problem.dates[0], unit='D')}); give --start "
            "only for a run without dated data"
        )
    problem.dates = first + np.arange(problem.ts.size).astype("timedelta64[D]")


def add_observations(
    ds: xr.Dataset, problem: Problem, params, observe: str, seed: int
) -> xr.Dataset:
    """`ds` (a `trajectory_dataset`) with a noisy series of every observation
    under its own name, drawn around `predicted_NAME` at its stamps (NaN
    between), and the covariates and initial-state variables the model reads
    from the data.

    Raises:
        ValueError: see `noise_of`; DataError: a name taken in `ds` already.
    """
    values = problem.model.constrain(params)
    families = {}
    new = {}
    for index, obs in enumerate(problem.spec.observations):
        family, kwargs = noise_of(obs, values, observe)
        families[obs.name] = family
        stamps = problem.stamps[obs.name]
        predicted = ds[f"predicted_{obs.name}"]
        drawn = sample_noise(
            observation_key(seed, index),
            family,
            predicted.values[stamps.days],
            **kwargs,
        )
        series = np.full(predicted.shape, np.nan)
        series[stamps.days] = drawn
        attrs = {
            "long_name": f"simulated observations of '{obs.name}': {family} "
            f"noise (seed {seed}) around the model prediction"
            + _period_text(stamps.period),
            "units": predicted.attrs["units"],
            "units_comment": predicted.attrs["units_comment"],
            "period": int(stamps.period),
        }
        new[obs.name] = (predicted.dims, series, attrs)
    new.update(_inputs(problem))
    _check_free(ds, new)
    out = ds.assign(new)
    out.attrs["observation_noise"] = json.dumps(families)
    out.attrs["observation_seed"] = int(seed)
    return out


def _period_text(period: int) -> str:
    if period == 1:
        return ""
    return f", the sum over the {period} days ending on each date"


def _inputs(problem: Problem) -> dict[str, xr.DataArray]:
    """The covariates and initial-state variables the model reads, on the
    output's patches and days (a time-varying covariate carries its last
    day forward beyond the data, as the solve does)."""
    if problem.dataset is None:
        return {}
    spec = problem.spec
    names = [c.name for c in spec.covariates]
    names += [i.data for i in spec.initial if i.data is not None]
    out = {}
    for name in dict.fromkeys(names):
        da = problem.dataset[name]
        for dim in (PATCH, PATCH_TO):
            if dim in da.dims and dim in da.coords:
                da = da.sel({dim: list(problem.patches)})
        if TIME in da.dims:
            rows = np.minimum(np.arange(problem.ts.size), da.sizes[TIME] - 1)
            da = da.isel({TIME: rows}).drop_vars(TIME, errors="ignore")
        out[name] = da
    return out


def _check_free(ds: xr.Dataset, new) -> None:
    """The names to add are not taken (by a compartment, say)."""
    taken = sorted(set(new) & (set(ds.variables) | set(ds.dims)))
    if taken:
        raise DataError(
            f"cannot write the simulated observations and inputs {taken}: the "
            "simulation output has variables of these names (compartments, "
            "state); rename the observation or data variable"
        )
