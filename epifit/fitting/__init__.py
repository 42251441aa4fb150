"""Binding models to data, simulation and calibration."""

from epifit.fitting._audit import AdjointAudit as AdjointAudit
from epifit.fitting._audit import audit_adjoints as audit_adjoints
from epifit.fitting._objective import make_objective as make_objective
from epifit.fitting._problem import Problem as Problem
from epifit.fitting._problem import as_model as as_model
from epifit.fitting._simulate import load_params as load_params
from epifit.fitting._simulate import simulate as simulate
from epifit.fitting._simulate import trajectory_dataset as trajectory_dataset
