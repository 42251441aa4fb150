"""Data layer: datasets and their conventions, I/O, validation, observation models.

One `xarray.Dataset` carries a problem's observations (`cases`, `deaths`,
`in_bed`, ... with dims `(time[, patch])`), its covariates (`mobility (time,
patch, feature)`, `coupling (time, patch, patch_to)`, `population (patch)`) and
CF-style metadata. This module is the package's public surface: it reads and
writes such datasets (`open_dataset`, `write_dataset`, `from_csv`), checks and
binds them to what a model requests (`validate_dataset`), and holds the
likelihood families and the delay and reporting helpers that compare a model's
output with the observations.

Cost: reading, writing and validating are NumPy/pandas work at call time,
linear in the data read; the likelihoods and reporting helpers are jitted JAX
functions, elementwise in the number of points, run inside the compiled
objective. See `docs/data.md` for the conventions and `epifit/data/README.md`
for what the package owns, imports and exports.
"""

from epifit._schema import COMPARTMENT as COMPARTMENT
from epifit._schema import CONVENTIONAL_DIMS as CONVENTIONAL_DIMS
from epifit._schema import COUPLING as COUPLING
from epifit._schema import DIMS as DIMS
from epifit._schema import FEATURE as FEATURE
from epifit._schema import MOBILITY as MOBILITY
from epifit._schema import PATCH as PATCH
from epifit._schema import PATCH_TO as PATCH_TO
from epifit._schema import POPULATION as POPULATION
from epifit._schema import QUANTILE as QUANTILE
from epifit._schema import SCENARIO as SCENARIO
from epifit._schema import STAGE as STAGE
from epifit._schema import TIME as TIME
from epifit.data._bind import BoundData as BoundData
from epifit.data._bind import time_index as time_index
from epifit.data._bind import validate_dataset as validate_dataset
from epifit.data._bind import weekday as weekday
from epifit.data._bind import weekday_of as weekday_of
from epifit.data._errors import DataError as DataError
from epifit.data._io import open_dataset as open_dataset
from epifit.data._io import write_dataset as write_dataset
from epifit.data._observation import (
    AbstractObservationModel as AbstractObservationModel,
)
from epifit.data._observation import Gaussian as Gaussian
from epifit.data._observation import NegativeBinomial as NegativeBinomial
from epifit.data._observation import Normal as Normal
from epifit.data._observation import Poisson as Poisson
from epifit.data._reporting import ascertain as ascertain
from epifit.data._reporting import expected_reports as expected_reports
from epifit.data._reporting import incidence as incidence
from epifit.data._reporting import normalize_week_effect as normalize_week_effect
from epifit.data._reporting import prevalence as prevalence
from epifit.data._reporting import week_effect as week_effect
from epifit.data._table import from_csv as from_csv
from epifit.data._validate import data_period as data_period
from epifit.model import AbstractDelay as AbstractDelay
from epifit.model import GammaDelay as GammaDelay
from epifit.model import LogNormalDelay as LogNormalDelay
from epifit.model import convolve_delay as convolve_delay
