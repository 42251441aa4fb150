"""epifit: fast, differentiable fitting of epidemic compartment models in JAX.

The curated top level; the layers live in `epifit.ode` (the ODE core),
`epifit.model` (declarative models), `epifit.data` (datasets and observation
models), `epifit.fitting` (binding, simulation, calibration) and
`epifit.forecasting` (scenarios and ensembles).

The names below are imported on first use (PEP 562), so `import epifit.ode`
or `epifit --help` does not pay for xarray, pandas and optax.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from epifit._lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "jit": "epifit._jit",
    "enable_compilation_cache": "epifit._cache",
    "DataError": "epifit.data",
    "open_dataset": "epifit.data",
    "write_dataset": "epifit.data",
    "FitResult": "epifit.fitting",
    "Problem": "epifit.simulation",
    "calibrate": "epifit.fitting",
    "profile": "epifit.fitting",
    "simulate": "epifit.simulation",
    "sample": "epifit.sampling",
    "Posterior": "epifit.sampling",
    "forecast": "epifit.forecasting",
    "ModelBuilder": "epifit.model",
    "ModelSpecError": "epifit.model",
    "compile_model": "epifit.model",
    "load_model": "epifit.model",
    "SolverError": "epifit.ode",
    "solve": "epifit.ode",
}
__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


if TYPE_CHECKING:  # for type checkers and editors
    from epifit._cache import enable_compilation_cache as enable_compilation_cache
    from epifit._jit import jit as jit
    from epifit.data import DataError as DataError
    from epifit.data import open_dataset as open_dataset
    from epifit.data import write_dataset as write_dataset
    from epifit.fitting import FitResult as FitResult
    from epifit.fitting import calibrate as calibrate
    from epifit.fitting import profile as profile
    from epifit.forecasting import forecast as forecast
    from epifit.model import ModelBuilder as ModelBuilder
    from epifit.model import ModelSpecError as ModelSpecError
    from epifit.model import compile_model as compile_model
    from epifit.model import load_model as load_model
    from epifit.ode import SolverError as SolverError
    from epifit.ode import solve as solve
    from epifit.sampling import Posterior as Posterior
    from epifit.sampling import sample as sample
    from epifit.simulation import Problem as Problem
    from epifit.simulation import simulate as simulate
