"""Calibration: the objective, free parameters and priors, optimisers,
checkpoints, uncertainty and fit results (see README.md)."""

from epifit.fitting._audit import AdjointAudit as AdjointAudit
from epifit.fitting._audit import audit_adjoints as audit_adjoints
from epifit.fitting._calibrate import calibrate as calibrate
from epifit.fitting._checkpoint import CheckpointError as CheckpointError
from epifit.fitting._checkpoint import checkpoint_path as checkpoint_path
from epifit.fitting._checkpoint import fingerprint as fingerprint
from epifit.fitting._config import MAX_STARTS as MAX_STARTS
from epifit.fitting._config import FitConfig as FitConfig
from epifit.fitting._config import FitConfigError as FitConfigError
from epifit.fitting._config import load_fit_config as load_fit_config
from epifit.fitting._config import parse_fit_config as parse_fit_config
from epifit.fitting._objective import Objective as Objective
from epifit.fitting._objective import observation_model as observation_model
from epifit.fitting._parameters import FreeParameters as FreeParameters
from epifit.fitting._parameters import LogNormal as LogNormal
from epifit.fitting._parameters import Normal as Normal
from epifit.fitting._parameters import leaf_labels as leaf_labels
from epifit.fitting._parameters import problem_labels as problem_labels
from epifit.fitting._parameters import time_labels as time_labels
from epifit.fitting._profile import ProfileError as ProfileError
from epifit.fitting._profile import profile as profile
from epifit.fitting._profile import profile_output as profile_output
from epifit.fitting._profile_plot import plot_profile as plot_profile
from epifit.fitting._profile_result import Profile as Profile
from epifit.fitting._progress import progress_enabled as progress_enabled
from epifit.fitting._resolve import check_fit_settings as check_fit_settings
from epifit.fitting._resolve import default_phases as default_phases
from epifit.fitting._resolve import fit_config as fit_config
from epifit.fitting._resolve import resolve_fit as resolve_fit
from epifit.fitting._result import FIT_GROUP as FIT_GROUP
from epifit.fitting._result import FitResult as FitResult
from epifit.fitting._result import library_versions as library_versions
from epifit.fitting._uncertainty import Laplace as Laplace
from epifit.fitting._uncertainty import laplace as laplace
