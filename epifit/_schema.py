"""Canonical names of dimensions and variables, defined once for all of epifit.

Every layer (model, ODE results, fitting, forecasting, CLI) names its axes with
these constants, so an xarray dim, a jaxtyping dim and the prose agree.
"""

from __future__ import annotations

from typing import Final

# Dimensions.
TIME: Final = "time"
"""Days of the observation / covariate grid. A daily `datetime64` coordinate
(integer days are accepted); `t = 0` is the first day."""
PATCH: Final = "patch"
"""Places (regions, age groups, ...). A coordinate of string labels."""
PATCH_TO: Final = "patch_to"
"""Second patch axis of a coupling matrix; same labels, same order as `patch`."""
FEATURE: Final = "feature"
"""Features of a covariate vector (e.g. mobility categories)."""
STAGE: Final = "stage"
"""Stages of a box-car (Erlang) chain within a compartment."""
COMPARTMENT: Final = "compartment"
"""Compartments of a model (`S`, `E`, `I`, ...)."""
QUANTILE: Final = "quantile"
"""Quantile levels of an ensemble summary."""
SCENARIO: Final = "scenario"
"""Forecast scenarios."""

DIMS: Final = (TIME, PATCH, PATCH_TO, FEATURE, STAGE, COMPARTMENT, QUANTILE, SCENARIO)
"""All canonical dimension names."""

# Variables with a conventional meaning and layout.
POPULATION: Final = "population"
"""Population size per patch, dims `(patch,)`, or a scalar for one population."""
MOBILITY: Final = "mobility"
"""Mobility covariates, dims `(time, patch, feature)`."""
COUPLING: Final = "coupling"
"""Coupling weights, dims `(time, patch, patch_to)`: `coupling[t, p, q]` is the
weight with which the infectious in patch `q` add to the force of infection in
patch `p` on day `t`."""

CONVENTIONAL_DIMS: Final[dict[str, tuple[str, ...]]] = {
    POPULATION: (PATCH,),
    MOBILITY: (TIME, PATCH, FEATURE),
    COUPLING: (TIME, PATCH, PATCH_TO),
}
"""Conventional dims of the named covariates (day-major: one day is contiguous)."""
