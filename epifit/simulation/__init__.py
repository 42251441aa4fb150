"""Running a model on data: a model bound to a dataset, solved, as xarray.

[`Problem`][] binds a compiled model to a dataset (covariates, initial data,
observations) as arrays ready for the solver; [`simulate`][] solves it and
returns the trajectories and observed series as an xarray Dataset;
[`synthetic_metapopulation`][] makes a synthetic dataset from a known model.
Fitting (`epifit.fitting`) and forecasting (`epifit.forecasting`) build on it.
"""

from epifit.simulation._problem import Problem as Problem
from epifit.simulation._run import ModelRun as ModelRun
from epifit.simulation._settings import ADJOINTS as ADJOINTS
from epifit.simulation._settings import SOLVERS as SOLVERS
from epifit.simulation._settings import SolverSettings as SolverSettings
from epifit.simulation._simulate import load_params as load_params
from epifit.simulation._simulate import simulate as simulate
from epifit.simulation._simulate import trajectory_dataset as trajectory_dataset
from epifit.simulation._synthetic import (
    synthetic_metapopulation as synthetic_metapopulation,
)
