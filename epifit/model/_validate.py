"""Validation of a raw model description (nested dicts, as TOML gives) into a
[`ModelSpec`][epifit.model.ModelSpec]. Both front doors go through here.

The sections are read in dependency order, each by a function of the shared
`SectionContext` (`_section.py`): compartments, covariates, parameters, neural
sub-models, derived quantities and couplings here, transitions and infections
in `_transition`, observations in `_observation`, then the initial state.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from epifit._errors import describe_type
from epifit._schema import FEATURE, PATCH, PATCH_TO, TIME
from epifit._toml import at, join
from epifit.model._derived_read import read_derived
from epifit.model._fields import (
    ALL_DIMS,
    COUPLING_DIMS,
    EXPRESSION_DIMS,
    MAX_STAGES,
    NEURAL_DIMS,
    RATE_NAMES,
    RULES,
)
from epifit.model._neural import ACTIVATIONS, canonical_activation
from epifit.model._observation_read import read_observations
from epifit.model._open import open_edges, read_inflows, read_outflows
from epifit.model._per_time_read import read_per_time, read_smoothing
from epifit.model._section import SectionContext
from epifit.model._spec import (
    NEURAL_FIXED,
    CompartmentSpec,
    CouplingSpec,
    CovariateSpec,
    InitialSpec,
    ModelSpec,
    NeuralSpec,
    ParameterSpec,
)
from epifit.model._strata import (
    cell_dims,
    check_kron_operands,
    check_stratum_values,
    read_contacts,
    read_per_stratum,
    read_strata,
    strata_dims_hint,
)
from epifit.model._transform import (
    TRANSFORMS,
    bounds_error,
    default_bounds,
    value_error,
)
from epifit.model._transition import read_infections, read_transitions

__all__ = ["spec_from_dict"]


def spec_from_dict(
    data: Any, *, file: str | None = None, default_name: str | None = None
) -> ModelSpec:
    """Validate a raw model description (as `tomllib` returns it).

    Args:
        data: nested dicts/lists in the TOML layout (see `docs/models.md`).
        file: where it came from, named in error messages.
        default_name: the model name when `name` is absent (a file's stem).

    Raises:
        ModelSpecError: naming the file, the field path and what is wrong.
    """
    ctx = SectionContext(data, file)
    r = ctx.r
    if "name" in ctx.raw:
        name = r.string(ctx.raw["name"], "name")
    elif default_name:
        name = default_name
    else:
        raise r.fail("name", "missing required field 'name'")
    description = ""
    if "description" in ctx.raw:
        description = r.string(ctx.raw["description"], "description")
    compartments = _read_compartments(ctx)
    ctx.strata = read_strata(ctx)
    covariates = _read_covariates(ctx)
    parameters = _read_parameters(ctx)
    neural = _read_neural(ctx)
    derived, series = read_derived(ctx)
    couplings = _read_couplings(ctx)
    transitions = read_transitions(ctx)
    infections = read_infections(ctx)
    inflows, outflows = read_inflows(ctx), read_outflows(ctx)
    observed = read_observations(
        ctx, transitions, infections, open_edges(inflows, outflows)
    )
    initial = _read_initial(ctx)
    for kind, specs in (("covariates", covariates), ("neural", neural)):
        for spec in specs:
            if spec.name not in ctx.used:
                raise r.fail(
                    at(kind, spec.name),
                    f"{spec.name!r} is declared but never used; remove it or "
                    "refer to it",
                )
    return ModelSpec(
        name=name,
        description=description,
        compartments=compartments,
        parameters=parameters + observed.parameters,
        derived=derived + observed.derived,
        series=series,
        transitions=transitions,
        infections=infections,
        inflows=inflows,
        outflows=outflows,
        couplings=couplings,
        neural=neural,
        covariates=covariates,
        observations=observed.observations,
        initial=initial,
        strata=ctx.strata,
        path=file,
        range_checks=tuple(ctx.range_checks),
    )


def _read_compartments(ctx: SectionContext) -> tuple[CompartmentSpec, ...]:
    r = ctx.r
    out = []
    for i, entry in enumerate(r.array(ctx.raw["compartments"], "compartments")):
        loc = at("compartments", i)
        if isinstance(entry, str):
            entry = {"name": entry}
        t = r.table(entry, loc, required=("name",), optional=("stages",))
        name = r.identifier(t["name"], at(loc, "name"), "compartment")
        stages = r.integer(t.get("stages", 1), at(loc, "stages"), 1)
        if stages > MAX_STAGES:
            raise r.fail(at(loc, "stages"), f"more than {MAX_STAGES} stages")
        ctx.declare(name, "compartment", at(loc, "name"))
        ctx.stages[name] = stages
        ctx.symbols[name] = ("compartment", True, False)  # its total, per patch
        out.append(CompartmentSpec(name, stages))
    return tuple(out)


def _read_covariates(ctx: SectionContext) -> tuple[CovariateSpec, ...]:
    r = ctx.r
    out = []
    rule_seen: tuple[str, str] | None = None
    for name, entry, loc in ctx.named_tables("covariates"):
        name = r.identifier(name, loc, "covariate")
        t = r.table(entry, loc, required=("dims",), optional=("rule",))
        dims = tuple(
            r.string(d, at(at(loc, "dims"), j))
            for j, d in enumerate(r.array(t["dims"], at(loc, "dims")))
        )
        data_dims = None
        if ctx.strata is not None:
            data_dims, dims = dims, cell_dims(dims, ctx.strata)
            if data_dims == dims:
                data_dims = None
        if dims not in ALL_DIMS:
            raise r.fail(
                at(loc, "dims"),
                f"unsupported dims {list(data_dims or dims)}; expected one of: "
                + "; ".join(str(list(d)) for d in ALL_DIMS)
                + strata_dims_hint(ctx),
            )
        rule = None
        if TIME in dims:
            if "rule" not in t:
                raise r.fail(
                    at(loc, "rule"),
                    "missing required field 'rule' for a covariate with a time "
                    'dim: "floor" (day k holds on [k, k+1)) or "nearest" (day k '
                    "holds on [k-1/2, k+1/2))",
                )
            rule = r.choice(t["rule"], at(loc, "rule"), RULES)
            if rule_seen is not None and rule != rule_seen[0]:
                raise r.fail(
                    at(loc, "rule"),
                    f"rule {rule!r} differs from rule {rule_seen[0]!r} of "
                    f"{rule_seen[1]}; all time-varying covariates share one day "
                    "grid and lookup rule",
                )
            rule_seen = (rule, loc)
        elif "rule" in t:
            raise r.fail(
                at(loc, "rule"),
                "a rule applies only to covariates with a time dim",
            )
        ctx.declare(name, "covariate", loc)
        if dims in EXPRESSION_DIMS:
            ctx.symbols[name] = ("covariate", PATCH in dims, TIME in dims)
        out.append(CovariateSpec(name, dims, rule, data_dims))
    ctx.covariate_dims = {c.name: c.dims for c in out}
    ctx.covariate_data_dims = {c.name: c.data_dims or c.dims for c in out}
    return tuple(out)


def _read_parameters(ctx: SectionContext) -> tuple[ParameterSpec, ...]:
    r = ctx.r
    out = []
    fields = ("transform", "bounds", "fixed", "per_patch", "per_time", "smoothing")
    fields += ("per_stratum",)
    for name, entry, loc in ctx.named_tables("parameters"):
        name = r.identifier(name, loc, "parameter")
        t = r.table(entry, loc, required=("value",), optional=fields)
        transform = r.choice(
            t.get("transform", "identity"), at(loc, "transform"), TRANSFORMS
        )
        fixed = r.boolean(t.get("fixed", False), at(loc, "fixed"))
        per_patch = r.boolean(t.get("per_patch", False), at(loc, "per_patch"))
        per_stratum = read_per_stratum(ctx, t, loc)
        lo, hi = default_bounds(transform)
        if "bounds" in t:
            bl = at(loc, "bounds")
            b = r.array(t["bounds"], bl)
            if len(b) != 2:
                raise r.fail(bl, f"expected [lower, upper], got {len(b)} entries")
            lo = r.number(b[0], at(bl, 0), finite=False)
            hi = r.number(b[1], at(bl, 1), finite=False)
            if (why := bounds_error(transform, lo, hi)) is not None:
                raise r.fail(bl, why)
        vl = at(loc, "value")
        raw_value = t["value"]
        if isinstance(raw_value, list | tuple):
            if not (per_patch or per_stratum):
                raise r.fail(
                    vl, "a list of values needs per_patch = true (one per patch)"
                )
            values = tuple(
                r.number(v, at(vl, j)) for j, v in enumerate(r.array(raw_value, vl))
            )
            value: float | tuple[float, ...] = values
        else:
            values = (r.number(raw_value, vl),)
            value = values[0]
        for v in values:
            if (why := value_error(transform, v, lo, hi)) is not None:
                raise r.fail(vl, why)
        per_time, smoothing = _read_time_fields(ctx, t, loc, fixed)
        if per_stratum:
            check_stratum_values(ctx, loc, len(values), per_time)
        ctx.declare(name, "parameter", loc)
        kind = "parameter" if per_time is None else "time-varying parameter"
        ctx.symbols[name] = (kind, per_patch or per_stratum, per_time is not None)
        ctx.start[name] = np.asarray(value, np.float64)
        if fixed:
            ctx.constants[name] = ctx.start[name]
        ctx.ranges[name] = (transform, lo, hi, fixed)
        out.append(
            ParameterSpec(
                name,
                value,
                transform,
                (lo, hi),
                fixed,
                per_patch,
                per_time,
                smoothing,
                per_stratum,
            )
        )
    return tuple(out)


def _read_time_fields(ctx: SectionContext, t, loc: str, fixed: bool):
    """`(per_time, smoothing)` of a parameter's table (each `None` if absent)."""
    r = ctx.r
    per_time = None
    if "per_time" in t:
        if fixed:
            raise r.fail(
                at(loc, "per_time"),
                "a fixed parameter does not vary in time; remove per_time or "
                "fixed = true",
            )
        per_time = read_per_time(r, t["per_time"], at(loc, "per_time"))
    smoothing = None
    if "smoothing" in t:
        smoothing = read_smoothing(r, t["smoothing"], at(loc, "smoothing"), per_time)
    return per_time, smoothing


def _read_neural(ctx: SectionContext) -> tuple[NeuralSpec, ...]:
    r = ctx.r
    out = []
    fields = (
        "layers",
        "in_size",
        "width",
        "depth",
        "activation",
        "final_activation",
        "time_input",
        "fixed",
    )
    for name, entry, loc in ctx.named_tables("neural"):
        name = r.identifier(name, loc, "neural sub-model")
        t = r.table(entry, loc, required=("covariate",), optional=fields)
        cov = _covariate_field(
            ctx, t, loc, NEURAL_DIMS, f"[{TIME}, {PATCH}, {FEATURE}];"
        )
        if "layers" in t:
            for other in ("in_size", "width", "depth"):
                if other in t:
                    raise r.fail(
                        at(loc, other),
                        "give either `layers` or `in_size`, `width` and `depth`",
                    )
            ll = at(loc, "layers")
            layers = [
                r.integer(v, at(ll, j), 1)
                for j, v in enumerate(r.array(t["layers"], ll))
            ]
            if len(layers) < 2 or layers[-1] != 1:
                raise r.fail(
                    ll,
                    "layers are [in_size, hidden..., 1] and end in 1 (a scalar "
                    f"rate per patch); got {layers}",
                )
            hidden = layers[1:-1]
            if len(set(hidden)) > 1:
                raise r.fail(
                    ll,
                    f"hidden layers must all have the same width (eqx.nn.MLP); "
                    f"got {hidden}",
                )
            in_size, depth = layers[0], len(hidden)
            width = hidden[0] if hidden else 0
        else:
            for req in ("in_size", "width", "depth"):
                if req not in t:
                    raise r.fail(
                        at(loc, req),
                        f"missing required field {req!r} (or give `layers`)",
                    )
            in_size = r.integer(t["in_size"], at(loc, "in_size"), 1)
            depth = r.integer(t["depth"], at(loc, "depth"), 0)
            width = r.integer(t["width"], at(loc, "width"), 1)
            if depth == 0:
                width = 0
        acts = []
        for key, default in (
            ("activation", "relu"),
            ("final_activation", "softplus"),
        ):
            a = r.choice(t.get(key, default), at(loc, key), tuple(ACTIVATIONS))
            acts.append(canonical_activation(a))
        time_input = r.boolean(t.get("time_input", False), at(loc, "time_input"))
        fixed = r.boolean_or(t.get("fixed", False), at(loc, "fixed"), NEURAL_FIXED)
        ctx.declare(name, "neural sub-model", loc)
        ctx.symbols[name] = ("neural sub-model", True, True)
        out.append(
            NeuralSpec(
                name,
                cov,
                in_size,
                width,
                depth,
                acts[0],
                acts[1],
                time_input,
                fixed,
            )
        )
    return tuple(out)


def _covariate_field(ctx: SectionContext, t, loc: str, allowed, dims: str) -> str:
    """The table's `covariate` field: a declared covariate with dims in
    `allowed` (`dims` says which in the error), marked as used."""
    cl = at(loc, "covariate")
    cov = ctx.r.string(t["covariate"], cl)
    if ctx.covariate_dims.get(cov) not in allowed:
        usable = [c for c, d in ctx.covariate_dims.items() if d in allowed]
        raise ctx.r.fail(
            cl,
            f"{cov!r} is not a covariate with dims {dims} such covariates: "
            f"{join(usable)}",
        )
    ctx.used.add(cov)
    return cov


def _read_couplings(ctx: SectionContext) -> tuple[CouplingSpec, ...]:
    r = ctx.r
    out = []
    fields = ("scale", "symmetrize", "multiplier", "local", "contacts")
    for name, entry, loc in ctx.named_tables("couplings"):
        name = r.identifier(name, loc, "coupling")
        t = r.table(entry, loc, required=("covariate",), optional=fields)
        cov = _covariate_field(
            ctx,
            t,
            loc,
            COUPLING_DIMS,
            f"[{TIME}, {PATCH}, {PATCH_TO}] or [{PATCH}, {PATCH_TO}];",
        )
        scale = None
        if "scale" in t:
            scale = ctx.expression(
                t["scale"], at(loc, "scale"), RATE_NAMES, "a coupling scale"
            )
        symmetrize = r.boolean(t.get("symmetrize", False), at(loc, "symmetrize"))
        multiplier = r.number(t.get("multiplier", 1.0), at(loc, "multiplier"))
        local = r.number(t.get("local", 1.0), at(loc, "local"))
        contacts = read_contacts(ctx, t, loc, cov)
        ctx.declare(name, "coupling", loc)
        out.append(
            CouplingSpec(name, cov, scale, symmetrize, multiplier, local, contacts)
        )
    check_kron_operands(ctx, out)
    ctx.coupling_names = [c.name for c in out]
    return tuple(out)


def _read_initial(ctx: SectionContext) -> tuple[InitialSpec, ...]:
    r = ctx.r
    raw = ctx.raw.get("initial", {})
    if not isinstance(raw, Mapping):
        raise r.fail("initial", f"expected a table, got {describe_type(raw)}")
    out = []
    allowed = ("parameter", "derived quantity", "covariate")
    for comp, entry in raw.items():
        loc = at("initial", str(comp))
        ctx.compartment(comp, loc)
        if isinstance(entry, Mapping):
            t = r.table(entry, loc, optional=("expression", "data"))
            if ("expression" in t) == ("data" in t):
                raise r.fail(loc, "give exactly one of `expression` and `data`")
            if "data" in t:
                out.append(InitialSpec(comp, data=r.string(t["data"], at(loc, "data"))))
                continue
            entry, loc = t["expression"], at(loc, "expression")
        expr = ctx.expression(entry, loc, allowed, "an initial condition")
        for n in expr.names:
            if ctx.symbols[n][0] == "covariate" and ctx.symbols[n][2]:
                raise r.fail(
                    loc,
                    f"covariate {n!r} varies in time; initial conditions may use "
                    f"covariates with dims [{PATCH}] only",
                )
        out.append(InitialSpec(comp, expression=expr))
    return tuple(out)
