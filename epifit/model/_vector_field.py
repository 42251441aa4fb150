"""The right-hand side of a compiled model: the state-dependent work only.

Everything that depends on (parameters, day) alone was evaluated before the
solve (`_precompute`) into `args` and the day's slice `u`; here each
evaluation reads those rates and forms the flows. Cost per evaluation: one
elementwise product per outflow and branch, and per infection one force of
infection (a reduction over the infectious stages, plus one or two coupling
matrix-vector products, dense `O(patch²)` or sparse `O(patch·k)`; for
`kron(M, C)` two contractions over the (patch, stratum) cells). The
coupling's product is computed once into its own buffer (`computed_once`)
even though two compartments read the force; it is also the value the
checkpoint adjoint keeps of each stage.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PyTree

from epifit._custom_types import Args, Y
from epifit.model._coupling import coupled_mass, coupling_matrix
from epifit.model._observation import flow_key
from epifit.model._once import computed_once
from epifit.model._plan import Infection, Plan, Slot
from epifit.model._state import state_value

__all__ = ["right_hand_side", "rows"]


def rows(r: Array) -> Array:
    """A rate of shape `()` or `(patch,)`, ready to scale a `(stage, patch)` array."""
    return r if jnp.ndim(r) == 0 else r[None, :]


def _getter(args: Args, u: PyTree | None, y: Y | None = None, state=()):
    """`get(key)`: the day's value of `key` from `u` if it varies, else `args`';
    a slot of `state` (it reads compartments) evaluated at `y`, once."""
    slots: dict[str, Slot] = {s.key: s for s in state}
    cache: dict[str, Array] = {}

    def get(key: str) -> Array:
        if key in slots:
            if key not in cache:
                cache[key] = state_value(slots[key], y, get)
            return cache[key]
        return u[key] if u is not None and key in u else args[key]

    return get


def right_hand_side(
    plan: Plan, compartments: tuple[str, ...], t: Any, y: Y, args: Args, u
) -> Y:
    """`dy/dt` of the flows `plan` lays out, for `y = {compartment: (stage,
    patch)}` (see [`CompiledModel.vector_field`][epifit.model.CompiledModel])."""
    state = plan.state_slots
    get = _getter(args, u, y, state)
    loss: dict[str, list[Array]] = {c: [] for c in compartments}
    gain: dict[str, list[Array]] = {c: [] for c in compartments}
    chain: dict[str, Array] = {}
    flows: dict[tuple[str, str], list[Array]] = {e: [] for e in plan.flows}
    for out in plan.outflows:
        x = y[out.compartment]
        rate = get(out.rate)
        flow = rows(rate) * x  # (stage, patch): leaving each stage
        loss[out.compartment].append(flow)
        chain[out.compartment] = flow
        exit_ = flow[-1]
        taken = []
        for b in out.branches:
            if b.kind == "all":
                f = exit_
            elif b.kind == "rate":
                f = get(b.slot) * x[-1]
            elif b.kind == "probability":
                f = get(b.slot) * exit_
            else:  # the remainder of a probability split
                f = exit_ - _total(taken)
            taken.append(f)
            gain[b.target].append(f)
            if (out.compartment, b.target) in flows:
                flows[out.compartment, b.target].append(f)
    for inf in plan.infections:
        lam = _force_of_infection(inf, y, get, once=_once_at(t))
        flow = rows(lam) * y[inf.source]
        loss[inf.source].append(flow)
        new = flow.sum(axis=0) if flow.shape[0] > 1 else flow[0]
        gain[inf.target].append(new)
        if (inf.source, inf.target) in flows:
            flows[inf.source, inf.target].append(new)
    _open_flows(plan, y, get, loss, gain, flows)
    dy = {}
    for name in compartments:
        x = y[name]
        lost = _total(loss[name])
        if gain[name]:
            first = _total(gain[name])[None, :]
        elif x.shape[0] == 1 and lost is not None:
            dy[name] = (-lost).astype(x.dtype)
            continue
        else:
            first = jnp.zeros_like(x[:1])
        if x.shape[0] > 1:
            rest = chain[name][:-1] if name in chain else jnp.zeros_like(x[1:])
            d = jnp.concatenate([first, rest], axis=0)
        else:
            d = first
        if lost is not None:
            d = d - lost
        dy[name] = d.astype(x.dtype)
    for edge, terms in flows.items():
        key = flow_key(edge)
        if (
            key in y
        ):  # a state without accumulators gets none (`initial_state` adds them)
            dy[key] = _total(terms)[None, :].astype(y[key].dtype)
    return dy


def _open_flows(plan: Plan, y: Y, get, loss, gain, flows) -> None:
    """Add the inflows from and removals to outside to `loss` and `gain` (and
    the observed ones to `flows`)."""
    for f in plan.inflows:
        x = y[f.target]
        new = jnp.broadcast_to(get(f.rate), x.shape[1:])  # (patch,)
        gain[f.target].append(new)
        if f.edge in flows:
            flows[f.edge].append(new)
    for r in plan.removals:
        x = y[r.compartment]
        flow = rows(get(r.rate)) * x  # (stage, patch)
        loss[r.compartment].append(flow)
        if r.edge in flows:
            flows[r.edge].append(flow.sum(axis=0) if flow.shape[0] > 1 else flow[0])


def _once_at(t):
    """`once(fn, *operands)`: [`computed_once`][] at time `t`."""

    def once(fn, *operands):
        return computed_once(fn, t, *operands)

    return once


def _force_of_infection(inf: Infection, y: Y, get, once) -> Float[Array, " patch"]:
    """`transmission * (local * i + coupled mass)` with `i` the (weighted,
    optionally population-normalised) infectious mass of `inf`'s sources;
    the coupling's matrix-vector product through `once` (see
    [`coupled_mass`][epifit.model.coupled_mass])."""
    i = None
    for s in inf.sources:
        x = y[s.compartment]
        sel = s.selection
        if sel is None:
            m = x.sum(axis=0) if x.shape[0] > 1 else x[0]
        elif len(sel) == 1:
            m = x[sel[0]]
        elif sel == tuple(range(sel[0], sel[-1] + 1)):
            m = x[sel[0] : sel[-1] + 1].sum(axis=0)
        else:
            m = x[np.asarray(sel)].sum(axis=0)
        if s.weight is not None:
            m = get(s.weight) * m
        i = m if i is None else i + m
    if inf.population is not None:
        i = i / get(inf.population)
    c = inf.coupling
    if c is None:
        force = i
    else:
        coupled = coupled_mass(
            i,
            coupling_matrix(get, c),
            None if c.scale is None else get(c.scale),
            symmetrize=c.symmetrize,
            multiplier=c.multiplier,
            once=once,
        )
        if c.local == 0.0:
            force = coupled
        elif c.local == 1.0:
            force = i + coupled
        else:
            force = c.local * i + coupled
    return get(inf.transmission) * force


def _total(terms: list[Array]) -> Array | None:
    """Sum of a list of arrays (no `0 +` start as with `sum`), or None if empty."""
    if not terms:
        return None
    out = terms[0]
    for term in terms[1:]:
        out = out + term
    return out
