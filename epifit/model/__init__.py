"""Declarative epidemic models: specs (TOML or Python) compiled to vector fields.

See `docs/models.md` for the TOML format.
"""

from epifit.model._breaks import break_days as break_days
from epifit.model._builders import ModelBuilder as ModelBuilder
from epifit.model._compiled import CompiledModel as CompiledModel
from epifit.model._compiled import as_model as as_model
from epifit.model._compiled import compile_model as compile_model
from epifit.model._coupling import KronCoupling as KronCoupling
from epifit.model._coupling import SparseCoupling as SparseCoupling
from epifit.model._coupling import sparse_coupling as sparse_coupling
from epifit.model._delay import AbstractDelay as AbstractDelay
from epifit.model._delay import GammaDelay as GammaDelay
from epifit.model._delay import LogNormalDelay as LogNormalDelay
from epifit.model._delay import convolve_delay as convolve_delay
from epifit.model._errors import ModelSpecError as ModelSpecError
from epifit.model._expression import Expression as Expression
from epifit.model._expression import parse_expression as parse_expression
from epifit.model._load import load_model as load_model
from epifit.model._load import loads_model as loads_model
from epifit.model._per_time import coefficient_labels as coefficient_labels
from epifit.model._per_time import constrain_coefficients as constrain_coefficients
from epifit.model._per_time import random_walk_nll as random_walk_nll
from epifit.model._per_time import random_walk_residuals as random_walk_residuals
from epifit.model._per_time import unconstrain_coefficients as unconstrain_coefficients
from epifit.model._reproduction import (
    basic_reproduction_number as basic_reproduction_number,
)
from epifit.model._reproduction import (
    has_reproduction_number as has_reproduction_number,
)
from epifit.model._reproduction import reproduction_number as reproduction_number
from epifit.model._reproduction import (
    reproduction_number_of as reproduction_number_of,
)
from epifit.model._serialize import parameters_json as parameters_json
from epifit.model._series import derived_series as derived_series
from epifit.model._spec import NEURAL_FIXED as NEURAL_FIXED
from epifit.model._spec import BranchSpec as BranchSpec
from epifit.model._spec import CompartmentSpec as CompartmentSpec
from epifit.model._spec import CouplingSpec as CouplingSpec
from epifit.model._spec import CovariateSpec as CovariateSpec
from epifit.model._spec import DelaySpec as DelaySpec
from epifit.model._spec import DerivedSpec as DerivedSpec
from epifit.model._spec import InfectionSpec as InfectionSpec
from epifit.model._spec import InfectiousSpec as InfectiousSpec
from epifit.model._spec import InflowSpec as InflowSpec
from epifit.model._spec import InitialSpec as InitialSpec
from epifit.model._spec import ModelSpec as ModelSpec
from epifit.model._spec import NeuralSpec as NeuralSpec
from epifit.model._spec import ObservationSpec as ObservationSpec
from epifit.model._spec import OutflowSpec as OutflowSpec
from epifit.model._spec import ParameterSpec as ParameterSpec
from epifit.model._spec import SmoothingSpec as SmoothingSpec
from epifit.model._spec import StrataSpec as StrataSpec
from epifit.model._spec import TimeBasisSpec as TimeBasisSpec
from epifit.model._spec import TransitionSpec as TransitionSpec
from epifit.model._state import STATE_NAMES as STATE_NAMES
from epifit.model._strata import cell_array as cell_array
from epifit.model._strata import kron_operands as kron_operands
from epifit.model._transform import TRANSFORMS as TRANSFORMS
from epifit.model._transform import bounds_error as bounds_error
from epifit.model._transform import constrain as constrain
from epifit.model._transform import default_bounds as default_bounds
from epifit.model._transform import unconstrain as unconstrain
from epifit.model._transform import value_error as value_error
from epifit.model._validate import spec_from_dict as spec_from_dict
