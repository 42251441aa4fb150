"""`[[observations]]` of a model file: what is observed (a level, a change or
a flow), through which reporting (delay, ascertainment, week effect, period)
and with which likelihood family."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from epifit._schema import PATCH
from epifit._toml import at, join
from epifit.model._expression import parse_expression
from epifit.model._fields import (
    DELAY_FAMILIES,
    EXPRESSION_DIMS,
    FAMILIES,
    KINDS,
    STATIC_NAMES,
    WEEKDAYS,
)
from epifit.model._section import SectionContext
from epifit.model._spec import (
    DelaySpec,
    DerivedSpec,
    InfectionSpec,
    ObservationSpec,
    ParameterSpec,
    TransitionSpec,
)
from epifit.model._strata import STRATA_OBSERVED

__all__ = ["Observations", "edges_of", "read_observations"]

FIELDS = (
    "strata",
    "compartments",
    "transition",
    "family",
    "weight",
    "sign",
    "dispersion",
    "sd",
    "ascertainment",
    "scale",
    "delay",
    "week_effect",
    "period",
)
PERIODS = {"day": 1, "week": 7}
MAX_DELAY_DAYS = 366


@dataclasses.dataclass(frozen=True)
class Observations:
    """What `[[observations]]` declares: the observations, and the parameters
    and derived quantities of their week effects."""

    observations: tuple[ObservationSpec, ...]
    parameters: tuple[ParameterSpec, ...] = ()
    derived: tuple[DerivedSpec, ...] = ()


def edges_of(
    transitions: tuple[TransitionSpec, ...], infections: tuple[InfectionSpec, ...]
) -> list[tuple[str, str]]:
    """The model's flows between compartments, `(source, target)`, in order."""
    edges: list[tuple[str, str]] = []
    for t in transitions:
        edges += [(t.source, b.target) for b in t.branches]
    edges += [(i.source, i.target) for i in infections]
    return list(dict.fromkeys(edges))


def read_observations(
    ctx: SectionContext,
    transitions: tuple[TransitionSpec, ...],
    infections: tuple[InfectionSpec, ...],
    open_edges: Sequence[tuple[str, str]] = (),
) -> Observations:
    """`[[observations]]`: data variables, what each observes, its reporting
    and its likelihood. `open_edges` are the flows from and to outside
    (`"births->S"`, `"I->deaths"`)."""
    r = ctx.r
    edges = edges_of(transitions, infections) + list(open_edges)
    out, names = [], set()
    parameters: list[ParameterSpec] = []
    derived: list[DerivedSpec] = []
    for _, entry, loc in ctx.listed_tables("observations"):
        t = r.table(entry, loc, required=("name", "kind"), optional=FIELDS)
        name = r.string(t["name"], at(loc, "name"))
        if name in names:
            raise r.fail(at(loc, "name"), f"data variable {name!r} observed twice")
        names.add(name)
        kind = r.choice(t["kind"], at(loc, "kind"), KINDS)
        comps, transition = _observed(ctx, t, loc, kind, edges)
        family, weight, dispersion, sd = _likelihood(ctx, t, loc)
        sign = _sign(ctx, t, loc, kind)
        if kind == "incidence":
            _check_one_way(ctx, at(loc, "compartments"), comps, sign, edges)
        week = None
        if "week_effect" in t:
            week, p, d = _week_effect(ctx, t["week_effect"], at(loc, "week_effect"))
            parameters += p
            derived.append(d)
        out.append(
            ObservationSpec(
                name,
                kind,
                comps,
                family,
                weight,
                sign,
                dispersion,
                _ascertainment(ctx, t, loc),
                _scale(ctx, t, loc),
                transition,
                sd,
                _delay(ctx, t, loc),
                week,
                _period(ctx, t, loc),
                _strata(ctx, t, loc),
            )
        )
    return Observations(tuple(out), tuple(parameters), tuple(derived))


def _observed(ctx: SectionContext, t, loc: str, kind: str, edges):
    """`(compartments, transition)`: what the observation reads."""
    r = ctx.r
    if kind == "flow":
        if "compartments" in t:
            raise r.fail(
                at(loc, "compartments"),
                "a flow observes a transition, not compartments; write transition = "
                '"FROM->TO"',
            )
        if "transition" not in t:
            raise r.fail(
                at(loc, "transition"),
                "missing; a flow observation names its transition, e.g. transition = "
                f'"{_arrow(edges[0]) if edges else "S->E"}"',
            )
        return (), _transition(ctx, t["transition"], at(loc, "transition"), edges)
    if "transition" in t:
        raise r.fail(at(loc, "transition"), 'applies only to kind = "flow"')
    cl = at(loc, "compartments")
    if "compartments" not in t:
        raise r.fail(cl, f"missing; a {kind} observation lists its compartments")
    raw = t["compartments"]
    if isinstance(raw, str):
        comps = (ctx.compartment(raw, cl),)
    else:
        comps = tuple(
            ctx.compartment(c, at(cl, j)) for j, c in enumerate(r.array(raw, cl))
        )
    if not comps:
        raise r.fail(cl, "lists no compartment")
    if len(set(comps)) != len(comps):
        raise r.fail(cl, f"repeated compartment in {list(comps)}")
    return comps, None


def _arrow(edge: tuple[str, str]) -> str:
    return f"{edge[0]}->{edge[1]}"


def _transition(ctx: SectionContext, value: Any, location: str, edges):
    """`"FROM->TO"`: an edge of the model's flows."""
    r = ctx.r
    text = r.string(value, location)
    parts = [p.strip() for p in text.split("->")]
    if len(parts) != 2 or not all(parts):
        raise r.fail(
            location, f'expected "FROM->TO" (source and target names), got {text!r}'
        )
    labels = {x for e in edges for x in e} - set(ctx.stages)  # outside's
    for p in parts:
        if p not in labels:
            ctx.compartment(p, location)
    edge = (parts[0], parts[1])
    if edge not in edges:
        raise r.fail(
            location,
            f"the model has no flow {_arrow(edge)}; its flows: "
            f"{join(_arrow(e) for e in edges)}",
        )
    return edge


def _check_one_way(ctx: SectionContext, location: str, comps, sign: int, edges):
    """An incidence (the daily change of `comps`) counts events only when the
    compartments' flows run one way: no inflows for `sign = -1`, no outflows
    for `sign = 1`."""
    group = set(comps)
    inflows = [e for e in edges if e[1] in group and e[0] not in group]
    outflows = [e for e in edges if e[0] in group and e[1] not in group]
    wrong, counted = (inflows, outflows) if sign == -1 else (outflows, inflows)
    if not wrong:
        return
    what = "inflows" if sign == -1 else "outflows"
    change = "minus the daily change" if sign == -1 else "the daily change"
    hint = " or ".join(f'kind = "flow", transition = "{_arrow(e)}"' for e in counted)
    raise ctx.r.fail(
        location,
        f'kind = "incidence" observes {change} of {join(comps)}, which is not a '
        f"count of events: they also have {what} {join(_arrow(e) for e in wrong)}; "
        + (
            f"observe the flow instead: {hint}"
            if hint
            else 'observe a flow instead (kind = "flow", transition = "FROM->TO")'
        ),
    )


def _sign(ctx: SectionContext, t, loc: str, kind: str) -> int:
    r = ctx.r
    if "sign" not in t:
        return 1
    if kind != "incidence":
        raise r.fail(at(loc, "sign"), 'applies only to kind = "incidence"')
    sign = r.integer(t["sign"], at(loc, "sign"), -1)
    if sign not in (-1, 1):
        raise r.fail(at(loc, "sign"), f"must be 1 or -1, got {sign}")
    return sign


def _static_name(ctx: SectionContext, value: Any, location: str) -> str:
    """The name of a parameter or derived quantity."""
    name = ctx.r.string(value, location)
    if ctx.symbols.get(name, ("",))[0] not in STATIC_NAMES:
        known = [n for n, s in ctx.symbols.items() if s[0] in STATIC_NAMES]
        raise ctx.r.fail(location, f"unknown parameter {name!r}; known: {join(known)}")
    ctx.used.add(name)
    return name


def _likelihood(ctx: SectionContext, t, loc: str):
    """`(family, weight, dispersion, sd)`."""
    r = ctx.r
    family = r.choice(t.get("family", "least_squares"), at(loc, "family"), FAMILIES)
    weight = r.number(t.get("weight", 1.0), at(loc, "weight"))
    if weight <= 0:
        raise r.fail(at(loc, "weight"), f"must be > 0, got {weight}")
    dispersion, sd = None, None
    dl, sl = at(loc, "dispersion"), at(loc, "sd")
    if "dispersion" in t:
        if family != "negative_binomial":
            raise r.fail(dl, f"a {family} likelihood has no dispersion")
        dispersion = _static_name(ctx, t["dispersion"], dl)
    elif family == "negative_binomial":
        raise r.fail(
            dl, "missing; a negative binomial likelihood needs a dispersion parameter"
        )
    if "sd" in t:
        if family != "gaussian":
            raise r.fail(
                sl,
                f"a {family} likelihood has no sd"
                + (
                    "; its spread is 1 / sqrt(2 weight)"
                    if family == "least_squares"
                    else ""
                ),
            )
        sd = ctx.expression(t["sd"], sl, STATIC_NAMES, "a standard deviation")
    elif family == "gaussian":
        raise r.fail(
            sl,
            "missing; a gaussian likelihood needs its standard deviation (sd = "
            '"sigma", a parameter, fitted or fixed); for weighted least squares '
            'write family = "least_squares" (with weight)',
        )
    return family, weight, dispersion, sd


def _ascertainment(ctx: SectionContext, t, loc: str):
    if "ascertainment" not in t:
        return None
    al = at(loc, "ascertainment")
    expr = ctx.expression(
        t["ascertainment"], al, (*STATIC_NAMES, "covariate"), "an ascertainment"
    )
    _check_covariate_dims(ctx, expr, al, EXPRESSION_DIMS, "an ascertainment")
    return expr


def _scale(ctx: SectionContext, t, loc: str):
    if "scale" not in t:
        return None
    sl = at(loc, "scale")
    scale = ctx.expression(t["scale"], sl, (*STATIC_NAMES, "covariate"), "a scale")
    for n in sorted(scale.names):
        sym = ctx.symbols[n]
        if sym[0] == "covariate" and sym[2]:
            raise ctx.r.fail(
                sl,
                f"covariate {n!r} varies in time; a scale may use parameters "
                f"and ({PATCH}) covariates such as a population only (a "
                "time-varying factor belongs in the ascertainment)",
            )
    return scale


def _check_covariate_dims(ctx: SectionContext, expr, location, allowed, what):
    for n in sorted(expr.names):
        dims = ctx.covariate_dims.get(n)
        if dims is not None and tuple(dims) not in allowed:
            raise ctx.r.fail(
                location,
                f"covariate {n!r} has dims {dims}; {what} may read covariates of "
                f"dims {join(str(d) for d in allowed)}",
            )


def _delay(ctx: SectionContext, t, loc: str) -> DelaySpec | None:
    """`delay = { family, mean, sd, max_days }`."""
    if "delay" not in t:
        return None
    r = ctx.r
    dl = at(loc, "delay")
    d = r.table(
        t["delay"], dl, required=("family", "mean", "sd"), optional=("max_days",)
    )
    family = r.choice(d["family"], at(dl, "family"), DELAY_FAMILIES)
    mean = ctx.expression(d["mean"], at(dl, "mean"), STATIC_NAMES, "a delay mean")
    sd = ctx.expression(d["sd"], at(dl, "sd"), STATIC_NAMES, "a delay sd")
    ml = at(dl, "max_days")
    max_days = r.integer(d.get("max_days", 30), ml, 0)
    if max_days > MAX_DELAY_DAYS:
        raise r.fail(ml, f"must be in [0, {MAX_DELAY_DAYS}] days, got {max_days}")
    return DelaySpec(family, mean, sd, max_days)


def _period(ctx: SectionContext, t, loc: str) -> int:
    """`period = "day" | "week" | N` (days), default 1."""
    if "period" not in t:
        return 1
    r = ctx.r
    pl = at(loc, "period")
    value = t["period"]
    if isinstance(value, str):
        return PERIODS[r.choice(value, pl, tuple(PERIODS))]
    return r.integer(value, pl, 1)


def _week_effect(ctx: SectionContext, value: Any, location: str):
    """`week_effect = "NAME"` or `{ name = "NAME", values = [7], fixed = b }`:
    the parameters `NAME_mon` ... `NAME_sat` (log scale) and the derived
    `NAME_sun = -(their sum)`, so the seven sum to zero."""
    r = ctx.r
    values, fixed = np.zeros(7), False
    if isinstance(value, str):
        name = r.identifier(value, location, "week effect")
    else:
        w = r.table(value, location, required=("name",), optional=("values", "fixed"))
        name = r.identifier(w["name"], at(location, "name"), "week effect")
        fixed = r.boolean(w.get("fixed", False), at(location, "fixed"))
        if "values" in w:
            vl = at(location, "values")
            raw = r.array(w["values"], vl)
            if len(raw) != 7:
                raise r.fail(vl, f"expected 7 values (Monday first), got {len(raw)}")
            values = np.array([r.number(v, at(vl, j)) for j, v in enumerate(raw)])
            if abs(values.sum()) > 1e-6 * max(1.0, np.abs(values).max()):
                raise r.fail(
                    vl,
                    "the 7 log-scale effects must sum to 0 (a week effect moves "
                    f"reports between days), got a sum of {values.sum():g}",
                )
    names = [f"{name}_{d}" for d in WEEKDAYS]
    parameters = []
    for n, v in zip(names[:6], values[:6], strict=True):
        ctx.declare(n, "parameter", location)
        ctx.symbols[n] = ("parameter", False, False)
        ctx.start[n] = np.asarray(float(v))
        if fixed:
            ctx.constants[n] = ctx.start[n]
        ctx.ranges[n] = ("identity", -np.inf, np.inf, fixed)
        parameters.append(ParameterSpec(n, float(v), fixed=fixed))
    ctx.declare(names[6], "derived quantity", location)
    ctx.symbols[names[6]] = ("derived quantity", False, False)
    expr = parse_expression(
        "-(" + " + ".join(names[:6]) + ")", file=ctx.file, location=location
    )
    ctx.start[names[6]] = -sum(ctx.start[n] for n in names[:6])
    if fixed:
        ctx.constants[names[6]] = ctx.start[names[6]]
    ctx.used.update(names)
    return name, parameters, DerivedSpec(names[6], expr)


def _strata(ctx: SectionContext, t, loc: str) -> str | None:
    """`strata`: "sum" (the default) or "each" in a model with `[strata]`."""
    if ctx.strata is None:
        if "strata" in t:
            raise ctx.r.fail(at(loc, "strata"), "needs a [strata] table")
        return None
    return ctx.r.choice(t.get("strata", "sum"), at(loc, "strata"), STRATA_OBSERVED)
