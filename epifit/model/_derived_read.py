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
    for name in sorted(series):
        _check_output_name(ctx, name, locations[name])
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


# Names the outputs of simulate, FIT.nc and forecasts give their own
# variables and coordinates: a derived series written under one of them
# would overwrite it.
_OUTPUT_NAMES = frozenset(
    {
        "state", "state_row", "compartment_of_row", "time", "day", "patch",
        "quantile", "scenario", "scenario_description", "R_eff", "R_eff_total",
        "R0", "x", "se", "estimate", "lower", "upper", "covariance",
        "coefficient", "coefficients", "coefficient_free", "loss_history",
        "grad_norm_history", "phase_history", "step_history", "start_loss",
        "start_initial_loss", "failed_samples", "iteration", "parameter",
        "parameter_kind", "parameter_name", "parameter_patch", "free",
        "free_to", "start",
    }
)  # fmt: skip
_OUTPUT_PREFIXES = (
    "predicted_", "observed_", "residual_", "estimate_", "cumulative_", "peak_",
)  # fmt: skip


def _check_output_name(ctx: SectionContext, name: str, loc: str) -> None:
    """A derived series is written as a variable named after it: refuse the
    names the outputs already use."""
    taken = name in _OUTPUT_NAMES or name.startswith(_OUTPUT_PREFIXES)
    observed = [e for _, e, _ in ctx.listed_tables("observations")]
    totals = {f"{e.get('name')}_total" for e in observed if isinstance(e, Mapping)}
    if taken or name in totals:
        raise ctx.r.fail(
            loc,
            f"derived series {name!r} would be written over the output variable "
            "of that name (simulate, FIT.nc and forecasts write it); rename it",
        )


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
