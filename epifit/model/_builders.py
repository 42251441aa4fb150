"""Python front door: a small builder producing the same `ModelSpec` as TOML.

Each method adds one table in the TOML layout of `docs/models.md` (keyword
arguments are TOML fields; `None` means "not given"), and `build()` validates the
whole description with the same code as [`load_model`][epifit.model.load_model].
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from epifit.model._errors import ModelSpecError
from epifit.model._spec import ModelSpec
from epifit.model._validate import spec_from_dict

__all__ = ["ModelBuilder"]

_FILE = "ModelBuilder"


def _fields(**kwargs: Any) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if v is not None}


class ModelBuilder:
    """Build a [`ModelSpec`][epifit.model.ModelSpec] in Python.

    Methods return the builder, so calls chain.

    Examples:
        >>> spec = (
        ...     ModelBuilder("sir")
        ...     .compartment("S").compartment("I").compartment("R")
        ...     .parameter("N", 763.0, fixed=True)
        ...     .parameter("beta", 2.0, transform="softplus")
        ...     .parameter("gamma", 0.5, transform="softplus")
        ...     .parameter("I0", 1.0, transform="softplus")
        ...     .infection("S", "I", transmission="beta", infectious=["I"],
        ...                normalize="population", population="N")
        ...     .transition("I", "R", rate="gamma")
        ...     .initial("S", "N - I0").initial("I", "I0")
        ...     .observation("in_bed", "prevalence", ["I"])
        ...     .build()
        ... )
        >>> [c.name for c in spec.compartments]
        ['S', 'I', 'R']
    """

    def __init__(self, name: str, *, description: str | None = None):
        self._data: dict[str, Any] = _fields(name=name, description=description)

    def _named(self, section: str, name: str, value: Any) -> ModelBuilder:
        table = self._data.setdefault(section, {})
        if name in table:
            raise ModelSpecError(
                f"{name!r} is defined twice", file=_FILE, location=f"{section}.{name}"
            )
        table[name] = value
        return self

    def _listed(self, section: str, value: dict[str, Any]) -> ModelBuilder:
        self._data.setdefault(section, []).append(value)
        return self

    def compartment(self, name: str, stages: int = 1) -> ModelBuilder:
        """A compartment; `stages > 1` makes a box-car chain."""
        return self._listed("compartments", {"name": name, "stages": stages})

    def parameter(
        self,
        name: str,
        value: float | Sequence[float],
        *,
        transform: str | None = None,
        bounds: Sequence[float] | None = None,
        fixed: bool | None = None,
        per_patch: bool | None = None,
        per_time: int | Mapping[str, Any] | None = None,
        smoothing: Mapping[str, Any] | None = None,
    ) -> ModelBuilder:
        """A parameter; `value` is on the constrained scale; `per_time` and
        `smoothing` as in a model file (`7`, `{"kind": "spline", "knots":
        10}`, `{"kind": "random_walk", "sd": 0.2}`)."""
        if isinstance(value, Sequence) and not isinstance(value, str):
            value = list(value)
        if bounds is not None and isinstance(bounds, Sequence):
            bounds = list(bounds)
        return self._named(
            "parameters",
            name,
            _fields(
                value=value,
                transform=transform,
                bounds=bounds,
                fixed=fixed,
                per_patch=per_patch,
                per_time=dict(per_time) if isinstance(per_time, Mapping) else per_time,
                smoothing=None if smoothing is None else dict(smoothing),
            ),
        )

    def derived(self, name: str, expression: str | float) -> ModelBuilder:
        """A derived quantity, an expression of parameters."""
        return self._named("derived", name, expression)

    def covariate(
        self, name: str, dims: Sequence[str], *, rule: str | None = None
    ) -> ModelBuilder:
        """A covariate with named dims and, if it has a time dim, a lookup rule."""
        dims = (
            list(dims)
            if isinstance(dims, Sequence) and not isinstance(dims, str)
            else dims
        )
        return self._named("covariates", name, _fields(dims=dims, rule=rule))

    def neural(
        self,
        name: str,
        covariate: str,
        *,
        layers: Sequence[int] | None = None,
        in_size: int | None = None,
        width: int | None = None,
        depth: int | None = None,
        activation: str | None = None,
        final_activation: str | None = None,
        time_input: bool | None = None,
        fixed: bool | str | None = None,
    ) -> ModelBuilder:
        """An MLP mapping `covariate`'s features to a rate per patch (`fixed`:
        `True`, or `"hidden"` for its hidden layers only)."""
        if layers is not None and isinstance(layers, Sequence):
            layers = list(layers)
        return self._named(
            "neural",
            name,
            _fields(
                covariate=covariate,
                layers=layers,
                in_size=in_size,
                width=width,
                depth=depth,
                activation=activation,
                final_activation=final_activation,
                time_input=time_input,
                fixed=fixed,
            ),
        )

    def coupling(
        self,
        name: str,
        covariate: str,
        *,
        scale: str | float | None = None,
        symmetrize: bool | None = None,
        multiplier: float | None = None,
        local: float | None = None,
        contacts: str | None = None,
    ) -> ModelBuilder:
        """Metapopulation coupling through a matrix covariate (with `[strata]`
        and `contacts`, a contact matrix over strata: `kron(M, C)`)."""
        return self._named(
            "couplings",
            name,
            _fields(
                covariate=covariate,
                scale=scale,
                symmetrize=symmetrize,
                multiplier=multiplier,
                local=local,
                contacts=contacts,
            ),
        )

    def transition(
        self,
        from_: str,
        to: str | None = None,
        *,
        rate: str | float | None = None,
        rate_per: str | None = None,
        branches: Sequence[Mapping[str, Any]] | None = None,
    ) -> ModelBuilder:
        """Progression out of `from_` into `to`, or split over `branches`
        (`[{"to": ..., "rate": ...}, ...]` or `[{"to": ..., "probability": ...},
        {"to": ...}]` with a `rate`)."""
        if branches is not None and isinstance(branches, Sequence):
            branches = [
                copy.deepcopy(dict(b)) if isinstance(b, Mapping) else b
                for b in branches
            ]
        return self._listed(
            "transitions",
            {
                "from": from_,
                **_fields(to=to, rate=rate, rate_per=rate_per, branches=branches),
            },
        )

    def infection(
        self,
        from_: str,
        to: str,
        *,
        transmission: str | float,
        infectious: Sequence[str | Mapping[str, Any]],
        normalize: str | None = None,
        population: str | float | None = None,
        coupling: str | None = None,
    ) -> ModelBuilder:
        """Infection of `from_` into `to`; `infectious` lists compartments or
        `{"compartment": ..., "stages": [...], "weight": ...}` tables."""
        if isinstance(infectious, Sequence) and not isinstance(infectious, str):
            infectious = [
                copy.deepcopy(dict(i)) if isinstance(i, Mapping) else i
                for i in infectious
            ]
        return self._listed(
            "infections",
            {
                "from": from_,
                "to": to,
                **_fields(
                    transmission=transmission,
                    infectious=infectious,
                    normalize=normalize,
                    population=population,
                    coupling=coupling,
                ),
            },
        )

    def inflow(
        self, to: str, rate: str | float, *, name: str | None = None
    ) -> ModelBuilder:
        """`rate` individuals per day (per patch) entering stage 1 of `to` from
        outside (births, importations); `name` labels the edge `"name->to"`."""
        return self._listed("inflows", {"to": to, "rate": rate, **_fields(name=name)})

    def outflow(
        self,
        rate: str | float,
        *,
        from_: str | Sequence[str] | None = None,
        name: str | None = None,
    ) -> ModelBuilder:
        """Every stage of `from_` (default: every compartment) leaving to
        outside at the per-capita `rate` (deaths); `name` labels the edges
        `"FROM->name"`."""
        if isinstance(from_, Sequence) and not isinstance(from_, str):
            from_ = list(from_)
        return self._listed(
            "outflows", {"rate": rate, **_fields(name=name, **{"from": from_})}
        )

    def observation(
        self,
        name: str,
        kind: str,
        compartments: str | Sequence[str] | None = None,
        *,
        transition: str | None = None,
        family: str | None = None,
        weight: float | None = None,
        sign: int | None = None,
        dispersion: str | None = None,
        sd: str | float | None = None,
        ascertainment: str | float | None = None,
        scale: str | float | None = None,
        delay: Mapping[str, Any] | None = None,
        week_effect: str | Mapping[str, Any] | None = None,
        period: str | int | None = None,
    ) -> ModelBuilder:
        """An observed data variable: the `prevalence` or `incidence` of
        compartments, or the `flow` along a `transition` (`"S->E"`), with its
        reporting (`delay = {"family", "mean", "sd", "max_days"}`,
        `ascertainment`, `scale`, `week_effect`, `period`) and likelihood
        (`family`, `weight`, `dispersion`, `sd`), as in model files (see
        `docs/models.md`).

        `scale` converts the model's units to the data's (e.g. `"population"`
        for a model in fractions of each patch observed as counts)."""
        if isinstance(compartments, Sequence) and not isinstance(compartments, str):
            compartments = list(compartments)
        entry: dict[str, Any] = {"name": name, "kind": kind}
        if compartments is not None:
            entry["compartments"] = compartments
        return self._listed(
            "observations",
            {
                **entry,
                **_fields(
                    transition=transition,
                    family=family,
                    weight=weight,
                    sign=sign,
                    dispersion=dispersion,
                    sd=sd,
                    ascertainment=ascertainment,
                    scale=scale,
                    delay=None if delay is None else dict(delay),
                    week_effect=week_effect
                    if week_effect is None or isinstance(week_effect, str)
                    else dict(week_effect),
                    period=period,
                ),
            },
        )

    def initial(
        self,
        compartment: str,
        expression: str | float | None = None,
        *,
        data: str | None = None,
    ) -> ModelBuilder:
        """Initial condition: an expression (stage 1) or a data variable."""
        if data is not None:
            value: Any = (
                {"data": data}
                if expression is None
                else {"data": data, "expression": expression}
            )
        else:
            value = expression
        return self._named("initial", compartment, value)

    def to_dict(self) -> dict[str, Any]:
        """The description in the TOML layout (a deep copy)."""
        return copy.deepcopy(self._data)

    def build(self) -> ModelSpec:
        """Validate and freeze.

        Raises:
            ModelSpecError: as for TOML files, with `ModelBuilder` as the file.
        """
        return spec_from_dict(self.to_dict(), file=_FILE)
