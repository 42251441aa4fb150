"""Validation of `[[inflows]]` and `[[outflows]]`: flows from and to outside
the model (births, importations, deaths), which make a population open."""

from __future__ import annotations

from epifit._toml import at
from epifit.model._fields import STATE_RATE_NAMES
from epifit.model._section import SectionContext
from epifit.model._spec import InflowSpec, OutflowSpec

__all__ = ["open_edges", "read_inflows", "read_outflows"]

OUTSIDE = "outside"


def _label(ctx: SectionContext, t, loc: str) -> str:
    """The edge label `name` (default `"outside"`): an identifier that is
    none of the model's names, so `"births->S"` names one edge only."""
    if "name" not in t:
        return OUTSIDE
    name = ctx.r.identifier(t["name"], at(loc, "name"), "flow label")
    if name in ctx.names:
        raise ctx.r.fail(
            at(loc, "name"),
            f"{name!r} is already a {ctx.names[name]}; the label names the flow "
            f"from or to outside the model (an observed transition such as "
            f'"{name}->S") and must differ from the model\'s names',
        )
    return name


def read_inflows(ctx: SectionContext) -> tuple[InflowSpec, ...]:
    """`[[inflows]]`: `rate` individuals per day (per patch) enter stage 1 of
    `to` from outside (births, importations)."""
    r = ctx.r
    out = []
    for _, entry, loc in ctx.listed_tables("inflows"):
        t = r.table(entry, loc, required=("to", "rate"), optional=("name",))
        target = ctx.compartment(t["to"], at(loc, "to"))
        rate = ctx.expression(t["rate"], at(loc, "rate"), STATE_RATE_NAMES, "a rate")
        out.append(InflowSpec(target, rate, _label(ctx, t, loc)))
    return tuple(out)


def read_outflows(ctx: SectionContext) -> tuple[OutflowSpec, ...]:
    """`[[outflows]]`: every stage of the compartments `from` (default: all)
    is left at the per-capita `rate` to outside (deaths, emigration)."""
    r = ctx.r
    out = []
    for _, entry, loc in ctx.listed_tables("outflows"):
        t = r.table(entry, loc, required=("rate",), optional=("from", "name"))
        fl = at(loc, "from")
        if "from" not in t:
            sources = tuple(ctx.stages)
        elif isinstance(t["from"], str):
            sources = (ctx.compartment(t["from"], fl),)
        else:
            sources = tuple(
                ctx.compartment(c, at(fl, j))
                for j, c in enumerate(r.array(t["from"], fl))
            )
            if len(set(sources)) != len(sources):
                raise r.fail(fl, f"repeated compartment in {list(sources)}")
        rate = ctx.expression(t["rate"], at(loc, "rate"), STATE_RATE_NAMES, "a rate")
        out.append(OutflowSpec(sources, rate, _label(ctx, t, loc)))
    return tuple(out)


def open_edges(
    inflows: tuple[InflowSpec, ...], outflows: tuple[OutflowSpec, ...]
) -> list[tuple[str, str]]:
    """The edges `(label, target)` and `(source, label)` of the open flows, in
    order: what a flow observation may name besides the model's transitions."""
    edges = [(i.name, i.target) for i in inflows]
    edges += [(s, o.name) for o in outflows for s in o.sources]
    return list(dict.fromkeys(edges))
