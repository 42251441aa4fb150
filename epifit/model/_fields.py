"""The fields of a model file: section names, allowed values, the reader.

`ModelReader` is the located TOML reader (`epifit._toml.Reader`) of model
files: its errors are `ModelSpecError`s, and names may not shadow the
expression functions.
"""

from __future__ import annotations

from epifit._schema import FEATURE, PATCH, PATCH_TO, TIME
from epifit._toml import Reader
from epifit.model._errors import ModelSpecError
from epifit.model._expression import FUNCTIONS


class ModelReader(Reader):
    """The located reader of model descriptions."""

    error = ModelSpecError
    reserved = frozenset(FUNCTIONS)


MAX_STAGES = 10_000
TOP_LEVEL = (
    "name",
    "description",
    "compartments",
    "strata",
    "parameters",
    "derived",
    "covariates",
    "neural",
    "couplings",
    "transitions",
    "infections",
    "observations",
    "inflows",
    "outflows",
    "initial",
)
RULES = ("floor", "nearest")
KINDS = ("prevalence", "incidence", "flow")
FAMILIES = ("least_squares", "gaussian", "poisson", "negative_binomial")
DELAY_FAMILIES = ("gamma", "lognormal")
WEEKDAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
# dims of a covariate -> what it can be used as
EXPRESSION_DIMS = ((PATCH,), (TIME,), (TIME, PATCH))
NEURAL_DIMS = ((TIME, PATCH, FEATURE),)
COUPLING_DIMS = ((PATCH, PATCH_TO), (TIME, PATCH, PATCH_TO))
ALL_DIMS = EXPRESSION_DIMS + NEURAL_DIMS + COUPLING_DIMS


PLURALS = {
    "parameter": "parameters",
    "time-varying parameter": "time-varying parameters",
    "derived quantity": "derived quantities",
    "neural sub-model": "neural sub-models",
    "covariate": "covariates",
    "compartment": "compartments",
}
RATE_NAMES = (
    "parameter",
    "time-varying parameter",
    "derived quantity",
    "neural sub-model",
    "covariate",
)
# rates evaluated in the vector field may also read compartment totals
STATE_RATE_NAMES = (*RATE_NAMES, "compartment")
STATIC_NAMES = ("parameter", "derived quantity")


# The values a field requires, by the use named in messages (see
# `SectionContext.expression`): (lower, upper, lower bound included).
# Constant expressions (numbers, fixed parameters) and the initial values of
# the parameters are checked against them when the model is read.
REQUIRED_RANGES: dict[str, tuple[float, float, bool]] = {
    "a rate": (0.0, float("inf"), True),
    "a transmission rate": (0.0, float("inf"), True),
    "a probability": (0.0, 1.0, True),
    "an initial condition": (0.0, float("inf"), True),
    "a population": (0.0, float("inf"), False),
    "a standard deviation": (0.0, float("inf"), False),
    "a delay mean": (0.0, float("inf"), False),
    "a delay sd": (0.0, float("inf"), False),
}
