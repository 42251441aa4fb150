"""Validation of `[[transitions]]` and `[[infections]]`."""

from __future__ import annotations

from typing import Any

import numpy as np

from epifit._toml import at, join
from epifit.model._expression import Expression, fold
from epifit.model._fields import STATE_RATE_NAMES
from epifit.model._section import SectionContext
from epifit.model._spec import BranchSpec, InfectionSpec, InfectiousSpec, TransitionSpec

__all__ = ["read_infections", "read_rate", "read_transitions"]


def read_rate(ctx: SectionContext, value: Any, location: str) -> Expression:
    """A rate expression (may read anything a rate may, compartments included:
    a compartment's name is its total over its stages in the same patch)."""
    return ctx.expression(value, location, STATE_RATE_NAMES, "a rate")


def read_transitions(ctx: SectionContext) -> tuple[TransitionSpec, ...]:
    """`[[transitions]]`: at most one per compartment left; splits via `branches`."""
    r = ctx.r
    out = []
    left_by: dict[str, str] = {}
    fields = ("to", "rate", "rate_per", "branches")
    for _, entry, loc in ctx.listed_tables("transitions"):
        t = r.table(entry, loc, required=("from",), optional=fields)
        source = ctx.compartment(t["from"], at(loc, "from"))
        if source in left_by:
            raise r.fail(
                at(loc, "from"),
                f"compartment {source!r} is already left by {left_by[source]}; "
                "split one outflow into several destinations with a single "
                "transition and `branches = [...]`",
            )
        left_by[source] = loc
        stages = ctx.stages[source]
        if "rate_per" in t:
            rate_per = r.choice(t["rate_per"], at(loc, "rate_per"), ("stage", "chain"))
        elif stages > 1:
            raise r.fail(
                at(loc, "rate_per"),
                f"required because {source!r} has {stages} stages: write "
                'rate_per = "stage" (each stage is left at `rate`) or rate_per = '
                '"chain" (each stage is left at stages * rate, so the mean time '
                "in the chain is 1 / rate)",
            )
        else:
            rate_per = "stage"
        if ("to" in t) == ("branches" in t):
            raise r.fail(loc, "give exactly one of `to` and `branches`")
        rate = read_rate(ctx, t["rate"], at(loc, "rate")) if "rate" in t else None
        if "to" in t:
            target = ctx.compartment(t["to"], at(loc, "to"))
            if target == source:
                raise r.fail(at(loc, "to"), f"{source!r} cannot flow into itself")
            if rate is None:
                raise r.fail(at(loc, "rate"), "missing required field 'rate'")
            branches: tuple[BranchSpec, ...] = (BranchSpec(target),)
        else:
            branches = read_branches(
                ctx, t["branches"], at(loc, "branches"), source, rate
            )
        out.append(TransitionSpec(source, rate, rate_per, branches))
    return tuple(out)


def read_branches(
    ctx: SectionContext, value: Any, location: str, source: str, rate: Expression | None
) -> tuple[BranchSpec, ...]:
    """Branches split by probabilities (one takes the remainder) or by rates."""
    r = ctx.r
    items = r.array(value, location)
    if len(items) < 2:
        raise r.fail(location, "a split needs at least two branches; use `to`")
    out = []
    seen = set()
    for j, entry in enumerate(items):
        loc = at(location, j)
        b = r.table(entry, loc, required=("to",), optional=("rate", "probability"))
        target = ctx.compartment(b["to"], at(loc, "to"))
        if target == source:
            raise r.fail(at(loc, "to"), f"{source!r} cannot flow into itself")
        if target in seen:
            raise r.fail(at(loc, "to"), f"two branches lead to {target!r}")
        seen.add(target)
        if rate is None:
            if "probability" in b:
                raise r.fail(
                    at(loc, "probability"),
                    "probabilities split a transition's `rate`, which is missing; "
                    "give the transition a `rate`, or each branch its own `rate`",
                )
            if "rate" not in b:
                raise r.fail(
                    at(loc, "rate"),
                    "missing; without a `rate` on the transition every branch "
                    "needs its own `rate`",
                )
            out.append(
                BranchSpec(target, rate=read_rate(ctx, b["rate"], at(loc, "rate")))
            )
        else:
            if "rate" in b:
                raise r.fail(
                    at(loc, "rate"),
                    "the transition has a `rate`; split it with `probability` on "
                    "the branches, or move the rates onto every branch",
                )
            prob = None
            if "probability" in b:
                prob = ctx.expression(
                    b["probability"],
                    at(loc, "probability"),
                    STATE_RATE_NAMES,
                    "a probability",
                )
            out.append(BranchSpec(target, probability=prob))
    if rate is not None and sum(b.probability is None for b in out) != 1:
        raise r.fail(
            location,
            "exactly one branch must omit `probability`: it receives the "
            "remainder 1 - (sum of the others), so the split conserves mass",
        )
    if rate is not None:
        _check_remainder(ctx, out, location)
    return tuple(out)


def _check_remainder(
    ctx: SectionContext, branches: list[BranchSpec], location: str
) -> None:
    """The probabilities known at load time (constants, or the parameters'
    initial values) leave a remainder >= 0 for the branch without one."""
    total = 0.0
    for b in branches:
        if b.probability is not None:
            value, _ = fold(b.probability, ctx.start)
            if value is not None:
                total = total + np.asarray(value, np.float64)
    worst = float(np.max(total))
    if worst > 1.0:
        rest = next(b.target for b in branches if b.probability is None)
        raise ctx.r.fail(
            location,
            f"the probabilities of the branches sum to {worst:g} > 1, so the "
            f"remainder branch to {rest!r} would get {1.0 - worst:g}; they must sum "
            "to at most 1",
        )


def read_infections(ctx: SectionContext) -> tuple[InfectionSpec, ...]:
    """`[[infections]]` with their infectious stages, normalisation, coupling."""
    r = ctx.r
    out = []
    fields = ("normalize", "population", "coupling")
    required = ("from", "to", "transmission", "infectious")
    for _, entry, loc in ctx.listed_tables("infections"):
        t = r.table(entry, loc, required=required, optional=fields)
        source = ctx.compartment(t["from"], at(loc, "from"))
        target = ctx.compartment(t["to"], at(loc, "to"))
        if target == source:
            raise r.fail(at(loc, "to"), f"{source!r} cannot infect into itself")
        transmission = ctx.expression(
            t["transmission"],
            at(loc, "transmission"),
            STATE_RATE_NAMES,
            "a transmission rate",
        )
        il = at(loc, "infectious")
        infectious = []
        seen = set()
        for j, item in enumerate(r.array(t["infectious"], il)):
            jl = at(il, j)
            if isinstance(item, str):
                item = {"compartment": item}
            it = r.table(
                item, jl, required=("compartment",), optional=("stages", "weight")
            )
            comp = ctx.compartment(it["compartment"], at(jl, "compartment"))
            if comp in seen:
                raise r.fail(at(jl, "compartment"), f"{comp!r} is listed twice")
            seen.add(comp)
            stages = None
            if "stages" in it:
                sl = at(jl, "stages")
                n = ctx.stages[comp]
                stages = tuple(
                    r.integer(s, at(sl, k), 1)
                    for k, s in enumerate(r.array(it["stages"], sl))
                )
                if max(stages) > n:
                    raise r.fail(
                        sl,
                        f"stage {max(stages)} does not exist: {comp!r} has stages "
                        f"1..{n} (stages are numbered from 1)",
                    )
                if len(set(stages)) != len(stages):
                    raise r.fail(sl, f"repeated stage in {list(stages)}")
                stages = tuple(sorted(stages))
            weight = None
            if "weight" in it:
                weight = ctx.expression(
                    it["weight"], at(jl, "weight"), STATE_RATE_NAMES, "a weight"
                )
            infectious.append(InfectiousSpec(comp, stages, weight))
        normalize = r.choice(
            t.get("normalize", "none"),
            at(loc, "normalize"),
            ("none", "population"),
        )
        population = None
        if normalize == "population":
            if "population" not in t:
                raise r.fail(
                    at(loc, "population"),
                    'missing; normalize = "population" divides the infectious mass '
                    "by `population` (a parameter, expression or covariate)",
                )
            population = ctx.expression(
                t["population"], at(loc, "population"), STATE_RATE_NAMES, "a population"
            )
        elif "population" in t:
            raise r.fail(
                at(loc, "population"),
                'used only with normalize = "population"',
            )
        coupling = None
        if "coupling" in t:
            cl = at(loc, "coupling")
            coupling = r.string(t["coupling"], cl)
            if coupling not in ctx.coupling_names:
                raise r.fail(
                    cl,
                    f"unknown coupling {coupling!r}; known: {join(ctx.coupling_names)}",
                )
        out.append(
            InfectionSpec(
                source,
                target,
                transmission,
                tuple(infectious),
                normalize,
                population,
                coupling,
            )
        )
    return tuple(out)
