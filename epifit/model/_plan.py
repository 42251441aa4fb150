"""The static plan a compiled model runs: which rate is evaluated where, which
flow goes from where to where. Built once from a `ModelSpec`; hashable."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping

from epifit.model._expression import Expression
from epifit.model._observation import observed_flows
from epifit.model._spec import ModelSpec

__all__ = ["Plan", "make_plan"]

_frozen = dataclasses.dataclass(frozen=True)


@_frozen
class Slot:
    """A rate-like quantity: `factor * sum(expressions)`.

    Static slots (depending on parameters and static covariates only) are
    evaluated once per solve into `args`; time-varying ones (reading a neural
    sub-model, a time-varying covariate or a time-varying parameter) once per
    day into `inputs`. A slot that reads compartments (`state`) is evaluated
    in the vector field, from `y` and the names it reads (`"names.NAME"` in
    `args` or `inputs`).
    """

    key: str
    expressions: tuple[Expression, ...]
    factor: float
    time_varying: bool
    state: tuple[str, ...] = ()  # the compartments read: evaluated from `y`


@_frozen
class Branch:
    target: str
    kind: str  # "all" | "rate" | "probability" | "rest"
    slot: str | None


@_frozen
class Outflow:
    compartment: str
    rate: str  # slot of the per-stage exit rate
    branches: tuple[Branch, ...]


@_frozen
class Source:
    compartment: str
    selection: tuple[int, ...] | None  # 0-based stages; None = all
    weight: str | None


@_frozen
class CouplingPlan:
    covariate: str
    matrix: str  # key in args or inputs
    time_varying: bool
    scale: str | None
    symmetrize: bool
    multiplier: float
    local: float
    contacts: str | None = None  # the covariate C of kron(M, C) ([strata])
    contacts_time_varying: bool = False

    @property
    def contacts_key(self) -> str:
        """The key of `C` in args or inputs."""
        return self.matrix.removesuffix(".matrix") + ".contacts"


@_frozen
class Infection:
    source: str
    target: str
    transmission: str
    sources: tuple[Source, ...]
    population: str | None
    coupling: CouplingPlan | None


@_frozen
class Inflow:
    """`rate` individuals per day enter stage 1 of `target` from outside."""

    target: str
    rate: str
    edge: tuple[str, str]


@_frozen
class Removal:
    """Every stage of `compartment` leaves to outside at the per-capita `rate`."""

    compartment: str
    rate: str
    edge: tuple[str, str]


@_frozen
class Plan:
    slots: tuple[Slot, ...]
    outflows: tuple[Outflow, ...]
    infections: tuple[Infection, ...]
    derived_order: tuple[str, ...]
    flows: tuple[tuple[str, str], ...] = ()  # observed, accumulated beside y
    inflows: tuple[Inflow, ...] = ()
    removals: tuple[Removal, ...] = ()

    @property
    def state_slots(self) -> tuple[Slot, ...]:
        """The slots evaluated in the vector field (they read compartments)."""
        return tuple(s for s in self.slots if s.state)


def dependency_order(deps: Mapping[str, Collection[str]]) -> list[str]:
    """The names of `deps` (name -> the names it reads), each after those it
    reads among them (acyclic: the validator checks it)."""
    order: list[str] = []

    def visit(name: str) -> None:
        if name in order:
            return
        for d in sorted(deps[name]):
            if d in deps:
                visit(d)
        order.append(name)

    for name in deps:
        visit(name)
    return order


def _derived_order(spec: ModelSpec) -> tuple[str, ...]:
    return tuple(dependency_order({d.name: d.expression.names for d in spec.derived}))


def make_plan(spec: ModelSpec) -> Plan:
    """Lay out the slots and flows of a validated spec."""
    time_varying = {n.name for n in spec.neural}
    time_varying |= {c.name for c in spec.covariates if c.time_varying}
    time_varying |= {p.name for p in spec.parameters if p.per_time is not None}
    stages = {c.name: c.stages for c in spec.compartments}
    slots: list[Slot] = []

    def slot(key: str, *exprs: Expression, factor: float = 1.0) -> str:
        tv = any(n in time_varying for e in exprs for n in e.names)
        state = sorted({n for e in exprs for n in e.names if n in stages})
        slots.append(Slot(key, tuple(exprs), factor, tv, tuple(state)))
        return key

    outflows = []
    for i, t in enumerate(spec.transitions):
        loc = f"transitions[{i}]"
        factor = float(stages[t.source]) if t.rate_per == "chain" else 1.0
        if t.rate is not None:
            rate = slot(f"{loc}.rate", t.rate, factor=factor)
            if len(t.branches) == 1:
                branches = (Branch(t.branches[0].target, "all", None),)
            else:
                branches = tuple(
                    Branch(b.target, "rest", None)
                    if b.probability is None
                    else Branch(
                        b.target,
                        "probability",
                        slot(f"{loc}.branches[{j}].probability", b.probability),
                    )
                    for j, b in enumerate(t.branches)
                )
                # the remainder last, so it is computed from all the others
                branches = tuple(sorted(branches, key=lambda b: b.kind == "rest"))
        else:
            rates = [b.rate for b in t.branches if b.rate is not None]
            rate = slot(f"{loc}.rate", *rates, factor=factor)
            branches = tuple(
                Branch(
                    b.target,
                    "rate",
                    slot(f"{loc}.branches[{j}].rate", b.rate, factor=factor),
                )
                for j, b in enumerate(t.branches)
                if b.rate is not None
            )
        outflows.append(Outflow(t.source, rate, branches))

    couplings = {c.name: c for c in spec.couplings}
    cov_tv = {c.name: c.time_varying for c in spec.covariates}
    infections = []
    for i, inf in enumerate(spec.infections):
        loc = f"infections[{i}]"
        sources = tuple(
            Source(
                s.compartment,
                None if s.stages is None else tuple(k - 1 for k in s.stages),
                None
                if s.weight is None
                else slot(f"{loc}.infectious[{j}].weight", s.weight),
            )
            for j, s in enumerate(inf.infectious)
        )
        population = None
        if inf.population is not None:
            population = slot(f"{loc}.population", inf.population)
        coupling = None
        if inf.coupling is not None:
            c = couplings[inf.coupling]
            scale = None
            if c.scale is not None:
                scale = f"couplings.{c.name}.scale"
                if scale not in {s.key for s in slots}:
                    slot(scale, c.scale)
            coupling = _coupling_plan(c, cov_tv, scale)
        infections.append(
            Infection(
                inf.source,
                inf.target,
                slot(f"{loc}.transmission", inf.transmission),
                sources,
                population,
                coupling,
            )
        )
    inflows, removals = _open_flows(spec, slot)
    return Plan(
        tuple(slots),
        tuple(outflows),
        tuple(infections),
        _derived_order(spec),
        observed_flows(spec.observations),
        inflows,
        removals,
    )


def _coupling_plan(c, time_varying, scale: str | None) -> CouplingPlan:
    """The plan of coupling `c`; `time_varying` by covariate name."""
    return CouplingPlan(
        covariate=c.covariate,
        matrix=f"couplings.{c.name}.matrix",
        time_varying=time_varying[c.covariate],
        scale=scale,
        symmetrize=c.symmetrize,
        multiplier=c.multiplier,
        local=c.local,
        contacts=c.contacts,
        contacts_time_varying=c.contacts is not None and time_varying[c.contacts],
    )


def _open_flows(
    spec: ModelSpec, slot
) -> tuple[tuple[Inflow, ...], tuple[Removal, ...]]:
    """The inflows from and removals to outside, their rates laid out by `slot`."""
    inflows = tuple(
        Inflow(f.target, slot(f"inflows[{i}].rate", f.rate), (f.name, f.target))
        for i, f in enumerate(spec.inflows)
    )
    removals = []
    for i, o in enumerate(spec.outflows):
        rate = slot(f"outflows[{i}].rate", o.rate)
        removals += [Removal(c, rate, (c, o.name)) for c in o.sources]
    return inflows, tuple(removals)
