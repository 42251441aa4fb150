"""`[derived]` of a model file: quantities of parameters, and *series* that
also read compartment totals or covariates (evaluated along trajectories,
`_series.py`)."""

from __future__ import annotations

from collections.abc import Mapping

from epifit._toml import at
from epifit.model._expression import fold
from epifit.model._fields import EXPRESSION_DIMS
from epifit.model._plan import dependency_order
from epifit.model._section import SectionContext
from epifit.model._spec import DerivedSpec

__all__ = ["read_derived"]


def read_derived(
    ctx: SectionContext,
) -> tuple[tuple[DerivedSpec, ...], tuple[DerivedSpec, ...]]:
    """`[derived]`: `(quantities, series)`. A quantity reads parameters and
    other quantities; a *series* also reads compartment totals or covariates
    (`prevalence = "I / N"`, `per_test = "cases_model / testing"`), or
    another series, and is reported along trajectories (time, patch), not
    usable in other expressions."""
    r = ctx.r
    entries = ctx.named_tables("derived")
    for name, _, loc in entries:
        r.identifier(name, loc, "derived quantity")
        ctx.declare(name, "derived quantity", loc)
    for name, _, _ in entries:
        ctx.symbols[name] = ("derived quantity", False, False)
    allowed = ("parameter", "derived quantity", "compartment", "covariate")
    out = []
    deps: dict[str, frozenset[str]] = {}
    locations: dict[str, str] = {}
    for name, entry, loc in entries:
        if isinstance(entry, Mapping):
            t = r.table(entry, loc, required=("expression",))
            entry, loc = t["expression"], at(loc, "expression")
        expr = ctx.expression(entry, loc, allowed, "a derived quantity", check=False)
        for n in sorted(expr.names):
            dims = ctx.covariate_dims.get(n)
            if dims is not None and tuple(dims) not in EXPRESSION_DIMS:
                raise r.fail(
                    loc,
                    f"covariate {n!r} has dims {dims}; a derived "
                    "quantity may read covariates of dims (patch), (time) "
                    "or (time, patch)",
                )
        deps[name] = expr.names
        locations[name] = loc
        out.append(DerivedSpec(name, expr))
    # cycles, and per-patch-ness inherited from what a quantity reads
    state: dict[str, int] = {}

    def visit(n: str, chain: list[str]) -> bool:
        if state.get(n) == 2:
            return ctx.symbols[n][1]
        if state.get(n) == 1:
            cycle = " -> ".join(chain[chain.index(n) :] + [n])
            raise r.fail(at("derived", n), f"circular definition: {cycle}")
        state[n] = 1
        per_patch = False
        for d in sorted(deps[n]):
            if d in deps:
                per_patch |= visit(d, [*chain, n])
            else:
                per_patch |= ctx.symbols[d][1]
        state[n] = 2
        ctx.symbols[n] = ("derived quantity", per_patch, False)
        return per_patch

    for name in deps:
        visit(name, [])
    series = _series_names(ctx, deps)
    for name in series:
        ctx.symbols[name] = ("derived series", True, True)
    out, series_specs = (
        [d for d in out if d.name not in series],
        tuple(d for d in out if d.name in series),
    )
    # the values known at load time, each after those it reads
    exprs = {d.name: d.expression for d in out}
    for name in dependency_order(deps):
        if name in series:
            continue
        ctx.check_value(exprs[name], locations[name], "a derived quantity")
        for env in (ctx.constants, ctx.start):
            value, _ = fold(exprs[name], env)
            if value is not None:
                env[name] = value
    return tuple(out), series_specs


def _series_names(ctx: SectionContext, deps) -> set[str]:
    """The derived names that read compartments or covariates, directly or
    through other derived names."""
    series = {
        n
        for n, names in deps.items()
        if any(
            ctx.symbols.get(m, ("",))[0] in ("compartment", "covariate") for m in names
        )
    }
    grew = True
    while grew:
        grew = False
        for n, names in deps.items():
            if n not in series and names & series:
                series.add(n)
                grew = True
    return series
