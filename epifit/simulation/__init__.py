"""Running a model on data: a model bound to a dataset, solved, as xarray.

[`Problem`][] binds a compiled model to a dataset (covariates, initial data,
observations) as arrays ready for the solver; [`SolverSettings`][] says how it
is solved and [`ModelRun`][] is the one solve of a model on data;
[`simulate`][] solves it and returns the trajectories and observed series as
an xarray Dataset; [`synthetic_metapopulation`][] makes a synthetic dataset
from a known model. Fitting (`epifit.fitting`) and forecasting
(`epifit.forecasting`) build on it.

The names are imported on first use (PEP 562), so the CLI's parser can read
`SolverSettings`, `SOLVERS` and `ADJOINTS` without loading xarray and pandas.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from epifit._lazy import lazy_exports

_EXPORTS = {
    "ADJOINTS": "epifit.simulation._settings",
    "OBSERVE": "epifit.simulation._noise",
    "noise_of": "epifit.simulation._noise",
    "noise_quantile": "epifit.simulation._noise",
    "observation_key": "epifit.simulation._noise",
    "sample_noise": "epifit.simulation._noise",
    "SOLVERS": "epifit.simulation._settings",
    "SolverSettings": "epifit.simulation._settings",
    "ModelRun": "epifit.simulation._run",
    "Problem": "epifit.simulation._problem",
    "load_params": "epifit.simulation._simulate",
    "simulate": "epifit.simulation._simulate",
    "trajectory_dataset": "epifit.simulation._simulate",
    "trajectory_numbers": "epifit.simulation._trajectory",
    "synthetic_metapopulation": "epifit.simulation._synthetic",
    "Stamps": "epifit.simulation._stamps",
    "at_stamps": "epifit.simulation._stamps",
    "period_sums": "epifit.simulation._stamps",
    "weekday_of": "epifit.simulation._stamps",
}
__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


if TYPE_CHECKING:  # for type checkers and editors
    from epifit.simulation._noise import OBSERVE as OBSERVE
    from epifit.simulation._noise import noise_of as noise_of
    from epifit.simulation._noise import noise_quantile as noise_quantile
    from epifit.simulation._noise import observation_key as observation_key
    from epifit.simulation._noise import sample_noise as sample_noise
    from epifit.simulation._problem import Problem as Problem
    from epifit.simulation._run import ModelRun as ModelRun
    from epifit.simulation._settings import ADJOINTS as ADJOINTS
    from epifit.simulation._settings import SOLVERS as SOLVERS
    from epifit.simulation._settings import SolverSettings as SolverSettings
    from epifit.simulation._simulate import load_params as load_params
    from epifit.simulation._simulate import simulate as simulate
    from epifit.simulation._simulate import trajectory_dataset as trajectory_dataset
    from epifit.simulation._stamps import Stamps as Stamps
    from epifit.simulation._stamps import at_stamps as at_stamps
    from epifit.simulation._stamps import period_sums as period_sums
    from epifit.simulation._stamps import weekday_of as weekday_of
    from epifit.simulation._synthetic import (
        synthetic_metapopulation as synthetic_metapopulation,
    )
    from epifit.simulation._trajectory import (
        trajectory_numbers as trajectory_numbers,
    )
