"""epifit: fast, differentiable fitting of epidemic compartment models in JAX.

The curated top level; the layers live in `epifit.ode` (the ODE core),
`epifit.model` (declarative models), `epifit.data` (datasets and observation
models), `epifit.fitting` (binding, simulation, calibration) and
`epifit.forecasting` (scenarios and ensembles).
"""

from epifit._jit import jit as jit
from epifit.data import DataError as DataError
from epifit.data import open_dataset as open_dataset
from epifit.data import write_dataset as write_dataset
from epifit.fitting import FitResult as FitResult
from epifit.fitting import Problem as Problem
from epifit.fitting import calibrate as calibrate
from epifit.fitting import simulate as simulate
from epifit.forecasting import forecast as forecast
from epifit.model import ModelBuilder as ModelBuilder
from epifit.model import ModelSpecError as ModelSpecError
from epifit.model import compile_model as compile_model
from epifit.model import load_model as load_model
from epifit.ode import SolverError as SolverError
from epifit.ode import solve as solve

__version__ = "0.1.0"
