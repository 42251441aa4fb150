"""The validated, frozen model specification.

Both front doors (TOML files via [`load_model`][epifit.model.load_model] and the
Python [`ModelBuilder`][epifit.model.ModelBuilder]) produce a [`ModelSpec`][]: a tree
of frozen dataclasses, hashable and comparable with `==`. Its field names follow the
TOML format (see `docs/models.md`), except that `from`/`to` are `source`/`target`.
"""

from __future__ import annotations

import dataclasses

from epifit._schema import TIME
from epifit.model._expression import Expression

__all__ = [
    "BranchSpec",
    "CompartmentSpec",
    "CouplingSpec",
    "CovariateSpec",
    "DelaySpec",
    "DerivedSpec",
    "InfectionSpec",
    "InfectiousSpec",
    "InflowSpec",
    "InitialSpec",
    "ModelSpec",
    "NeuralSpec",
    "ObservationSpec",
    "StrataSpec",
    "OutflowSpec",
    "ParameterSpec",
    "SmoothingSpec",
    "TimeBasisSpec",
    "TransitionSpec",
]

_frozen = dataclasses.dataclass(frozen=True)


@_frozen
class CompartmentSpec:
    """A compartment; `stages > 1` makes it a box-car chain, state `(stages, patch)`."""

    name: str
    stages: int = 1


@_frozen
class TimeBasisSpec:
    """How a time-varying parameter varies over the days (`per_time`).

    The value on day `d` is `transform(basis(d) @ coefficients)`, the
    coefficients on the unconstrained scale (see `epifit.model.constrain_coefficients`).

    Attributes:
        kind: `"pieces"` (constant on periods of `days` days from day 0),
            `"spline"` (a clamped cubic B-spline with `knots` basis functions
            over the fitted days) or `"periodic"` (a Fourier series of
            `harmonics` harmonics of `period` days).
    """

    kind: str
    days: int = 0
    knots: int = 0
    period: float = 0.0
    harmonics: int = 0


@_frozen
class SmoothingSpec:
    """A random-walk prior of `order` 1 or 2 on the unconstrained coefficients
    of a time-varying parameter: the `order`-th differences along time are
    independent `Normal(0, sd)`."""

    kind: str
    sd: float
    order: int = 1


@_frozen
class ParameterSpec:
    """A named parameter.

    Attributes:
        value: initial value(s) on the constrained scale: a float, or one per patch.
        transform: `identity`, `exp`, `softplus` or `sigmoid`.
        bounds: `(lower, upper)` of the constrained value; `exp`/`softplus` map
            onto `(lower, inf)`, `sigmoid` onto `(lower, upper)`.
        fixed: excluded from fitting (`free_mask` is False).
        per_patch: one value per patch, shape `(patch,)`.
        per_time: how it varies in time (`None`: constant); its coefficients
            have shape `(coefficient,)` or `(coefficient, patch)`.
        smoothing: a random-walk prior on those coefficients.
        per_stratum: one value per stratum (`[strata]`), shape `(stratum,)`,
            or `(patch, stratum)` with `per_patch`.
    """

    name: str
    value: float | tuple[float, ...]
    transform: str = "identity"
    bounds: tuple[float, float] = (float("-inf"), float("inf"))
    fixed: bool = False
    per_patch: bool = False
    per_time: TimeBasisSpec | None = None
    smoothing: SmoothingSpec | None = None
    per_stratum: bool = False


@_frozen
class DerivedSpec:
    """A quantity computed from parameters, e.g. `eta = -log(-expm1(-k*a))/g`."""

    name: str
    expression: Expression


@_frozen
class BranchSpec:
    """One destination of a transition: with its own rate, a probability, or
    (probability `None` in a probability split) the remainder."""

    target: str
    rate: Expression | None = None
    probability: Expression | None = None


@_frozen
class TransitionSpec:
    """Progression through a compartment's stages and out of its last stage.

    Attributes:
        source: the compartment left.
        rate: the total exit rate, or `None` when each branch has its own rate
            (the total is then their sum).
        rate_per: `"stage"`: each stage is left at `rate`; `"chain"`: each stage is
            left at `stages * rate` (mean time in the chain `1 / rate`).
        branches: destinations of the flow out of the last stage.
    """

    source: str
    rate: Expression | None
    rate_per: str
    branches: tuple[BranchSpec, ...]


@_frozen
class InfectiousSpec:
    """Compartment stages that add to the infectious mass (`stages` 1-based;
    `None` means all), with an optional relative weight."""

    compartment: str
    stages: tuple[int, ...] | None = None
    weight: Expression | None = None


@_frozen
class InfectionSpec:
    """Infection of `source` into stage 1 of `target` at the force of infection
    `transmission * (local * i + multiplier * scale * (C @ i))`, with `i` the
    infectious mass (divided by `population` when `normalize = "population"`)."""

    source: str
    target: str
    transmission: Expression
    infectious: tuple[InfectiousSpec, ...]
    normalize: str = "none"
    population: Expression | None = None
    coupling: str | None = None


@_frozen
class InflowSpec:
    """An inflow from outside the model (births, importations) into stage 1 of
    `target`: `rate` individuals per day in each patch (not per capita).
    `name` labels the edge `"name->target"` for flow observations."""

    target: str
    rate: Expression
    name: str = "outside"


@_frozen
class OutflowSpec:
    """A per-capita outflow to outside the model (deaths, emigration): every
    stage of each of `sources` is left at `rate`. `name` labels the edges
    `"source->name"` for flow observations."""

    sources: tuple[str, ...]
    rate: Expression
    name: str = "outside"


@_frozen
class CouplingSpec:
    """Metapopulation coupling through a matrix covariate `C[p, q]`.

    In a model with `[strata]`, `contacts` names a contact matrix over strata
    (data dims `(age, age_to)`) beside `covariate`, a matrix over patches
    (`(patch, patch_to)`): the coupling is then `kron(M, C)` on the cells,
    both kept on their own axes (`KronCoupling`)."""

    name: str
    covariate: str
    scale: Expression | None = None
    symmetrize: bool = False
    multiplier: float = 1.0
    local: float = 1.0
    contacts: str | None = None


@_frozen
class NeuralSpec:
    """An `eqx.nn.MLP` mapping a covariate's features to a rate per patch.

    `fixed`: `True` holds every weight and bias at its value, `"hidden"` the
    hidden layers' only, so that fits and the sampler move the output layer's
    weights and bias (with NUTS, a Bayesian last layer: the network's
    features fixed at a fit's values, the uncertainty of the rate they carry
    sampled with the other parameters)."""

    name: str
    covariate: str
    in_size: int
    width: int
    depth: int
    activation: str = "relu"
    final_activation: str = "softplus"
    time_input: bool = False
    fixed: bool | str = False


# the values of a neural sub-model's `fixed` besides true and false
NEURAL_FIXED = ("hidden",)


@_frozen
class CovariateSpec:
    """A covariate: its dims (named axes) and day lookup rule (`floor`/`nearest`).

    In a model with `[strata]`, `dims` are the dims on the cell axis (the
    patch axis of the compiled model: patch x stratum) and `data_dims` the
    dims the data give (`("patch", "age")`, `("age", "age_to")`)."""

    name: str
    dims: tuple[str, ...]
    rule: str | None = None
    data_dims: tuple[str, ...] | None = None

    @property
    def time_varying(self) -> bool:
        return TIME in self.dims


@_frozen
class DelaySpec:
    """A reporting delay: a gamma or log-normal distribution of the days from
    an event to its report, discretised to whole days up to `max_days`."""

    family: str
    mean: Expression
    sd: Expression
    max_days: int = 30


@_frozen
class ObservationSpec:
    """An observed data variable and how the model predicts it.

    Attributes:
        name: the data variable.
        kind: `prevalence` (the level of `compartments`), `incidence` (the
            change of a compartment with flows in one direction only) or
            `flow` (the amount along `transition` over each reporting period).
        compartments: the compartments summed (empty for a flow).
        family: `least_squares`, `gaussian`, `poisson` or `negative_binomial`.
        weight: the observation's relative weight in the loss.
        sign: `-1` for the incidence of a decreasing compartment.
        dispersion: the negative binomial's dispersion parameter.
        ascertainment: the reported fraction (parameters, covariates).
        scale: a unit conversion (parameters, `(patch,)` covariates).
        transition: `(source, target)` of a flow.
        sd: the gaussian standard deviation.
        delay: the reporting delay.
        week_effect: the name of the day-of-week effect (its parameters are
            `NAME_mon` ... `NAME_sat`, the derived `NAME_sun`).
        period: the days summed into each data point (1 daily, 7 weekly).
    """

    name: str
    kind: str
    compartments: tuple[str, ...]
    family: str = "least_squares"
    weight: float = 1.0
    sign: int = 1
    dispersion: str | None = None
    ascertainment: Expression | None = None
    scale: Expression | None = None
    transition: tuple[str, str] | None = None
    sd: Expression | None = None
    delay: DelaySpec | None = None
    week_effect: str | None = None
    period: int = 1
    strata: str | None = None
    """`"sum"` (compared summed over strata) or `"each"` (per stratum) in a
    model with `[strata]`; `None` without."""

    @property
    def interval(self) -> bool:
        """The data point counts events over a period (not a level)."""
        return self.kind != "prevalence"

    @property
    def first_day(self) -> int:
        """The day of the first predicted value: 0 for a level, 1 for an
        amount over a day (row `k` is the amount over day `k -> k + 1`)."""
        return 1 if self.interval else 0


@_frozen
class InitialSpec:
    """Initial condition of one compartment: an expression placed in stage 1, or
    a data variable of dims `(patch,)` or `(stage, patch)`."""

    compartment: str
    expression: Expression | None = None
    data: str | None = None


@_frozen
class StrataSpec:
    """The `[strata]` axis: its name (a dim of the data, e.g. `age`) and its
    labels in order. The compiled model's structure axis is the cell axis,
    patch-major: cell `p * len(labels) + s` is stratum `s` of patch `p`."""

    name: str
    labels: tuple[str, ...]

    @property
    def to(self) -> str:
        """The second axis of a matrix over strata (`age_to`)."""
        return self.name + "_to"

    @property
    def size(self) -> int:
        return len(self.labels)


@_frozen
class ModelSpec:
    """A complete, validated model. Compare with `==`; compile with
    [`compile_model`][epifit.model.compile_model].

    `path` (the file it came from) does not take part in comparisons.
    """

    name: str
    compartments: tuple[CompartmentSpec, ...]
    parameters: tuple[ParameterSpec, ...] = ()
    derived: tuple[DerivedSpec, ...] = ()
    series: tuple[DerivedSpec, ...] = ()  # [derived] reading the state/covariates
    transitions: tuple[TransitionSpec, ...] = ()
    infections: tuple[InfectionSpec, ...] = ()
    inflows: tuple[InflowSpec, ...] = ()
    outflows: tuple[OutflowSpec, ...] = ()
    couplings: tuple[CouplingSpec, ...] = ()
    neural: tuple[NeuralSpec, ...] = ()
    covariates: tuple[CovariateSpec, ...] = ()
    observations: tuple[ObservationSpec, ...] = ()
    initial: tuple[InitialSpec, ...] = ()
    description: str = ""
    strata: StrataSpec | None = None
    path: str | None = dataclasses.field(default=None, compare=False)
    range_checks: tuple = dataclasses.field(default=(), compare=False, repr=False)
    """`(location, context, expression)` of each expression whose field has a
    required range (rates >= 0, probabilities in [0, 1], ...), checked again
    at other parameter values by `CompiledModel.range_violations`."""

    @property
    def closed(self) -> bool:
        """No flow enters from or leaves to outside the model: the
        compartments' total is conserved in every patch."""
        return not (self.inflows or self.outflows)
