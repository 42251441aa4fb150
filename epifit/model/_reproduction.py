"""The reproduction number of a declared model: the next-generation matrix
`K = F V⁻¹` (van den Driessche and Watmough 2002) built from the plan, per day,
along a trajectory (`docs/models.md`, "The reproduction number").

*Infected states* are the stages reachable along transitions from stage 1 of
an infection's target that can still reach an infectious stage (E, the
infectious stages of ID, IR; not the non-infectious tail of ID, nor R).
`V` holds the exit and transfer rates among them, patch by patch (transitions
never leave a patch); `F` the new infections into the targets' stage 1, at
the day's susceptible amount, transmission rate, population and coupling.

The work is done on the *reduced* matrix over (infection, patch): one new
infection of kind `m` in patch `q` spends on average `G[q, n, m] = w_nᵀ
V_q⁻¹ e_m` weighted time infectious for infection `n`, which that infection
turns into `M_n[p, q]` new infections per unit in patch `p`:
`K_r[(n, p), (m, q)] = M_n[p, q] G[q, n, m]`. Its non-zero eigenvalues are
those of `F V⁻¹`. `K_r` is applied matrix-free (one force-of-infection
evaluation per product, sparse couplings kept sparse); the dense method
forms it by `jacfwd` and takes `eigvals`, the power method iterates it.

Costs per day: one batched solve of `V_q` (`patch × n³`, `n` the infected
states), then per product of `K_r` one coupling product (`O(patch²)` dense,
`O(patch·k)` sparse); the dense method `(infections·patch)³` for `eigvals`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array

from epifit.model._coupling import coupled_mass, coupling_matrix
from epifit.model._perron import (
    has_eig,
    radius_dense,
    radius_noda,
    radius_power,
    root_noda,
)
from epifit.model._plan import Infection, Plan

__all__ = [
    "basic_reproduction_number",
    "has_reproduction_number",
    "infected_states",
    "reproduction_number",
    "reproduction_number_of",
]

# the dense method up to this many (infection, patch) types under "auto"
DENSE_MAX = 64
# Noda's iteration (dense K_r) up to this many types under "auto"
NODA_MAX = 3000

State = tuple[str, int]  # (compartment, 0-based stage)


def _edges(plan: Plan, stages: Mapping[str, int]) -> dict[State, list[State]]:
    out: dict[State, list[State]] = {}
    for o in plan.outflows:
        k = stages[o.compartment]
        for j in range(k - 1):
            out.setdefault((o.compartment, j), []).append((o.compartment, j + 1))
        last = out.setdefault((o.compartment, k - 1), [])
        last += [(b.target, 0) for b in o.branches]
    return out


def _infectious(plan: Plan, stages: Mapping[str, int]) -> set[State]:
    found = set()
    for inf in plan.infections:
        for s in inf.sources:
            sel = range(stages[s.compartment]) if s.selection is None else s.selection
            found |= {(s.compartment, j) for j in sel}
    return found


def infected_states(plan: Plan, stages: Mapping[str, int]) -> tuple[State, ...]:
    """The infected states `(compartment, stage)`, in compartment and stage
    order: reachable along transitions from stage 1 of an infection's target
    and able to reach an infectious stage (see the module docstring).

    Raises:
        ValueError: without infections, or where an infected compartment is
            itself infected by an infection (its loss then depends on the
            state: not supported).
    """
    if not plan.infections:
        raise ValueError("the model has no [[infections]]: no reproduction number")
    edges = _edges(plan, stages)
    reach, todo = set(), [(i.target, 0) for i in plan.infections]
    while todo:
        s = todo.pop()
        if s not in reach:
            reach.add(s)
            todo += edges.get(s, [])
    back: dict[State, list[State]] = {}
    for a, bs in edges.items():
        for b in bs:
            back.setdefault(b, []).append(a)
    lead, todo = set(), list(_infectious(plan, stages))
    while todo:
        s = todo.pop()
        if s not in lead:
            lead.add(s)
            todo += back.get(s, [])
    infected = reach & lead
    order = {c: i for i, c in enumerate(stages)}
    states = tuple(sorted(infected, key=lambda s: (order[s[0]], s[1])))
    both = sorted({c for c, _ in states} & {i.source for i in plan.infections})
    if both:
        raise ValueError(
            f"compartment {both[0]!r} is infected and is the susceptible "
            "compartment of an infection: its reproduction number is not supported"
        )
    return states


def has_reproduction_number(model) -> bool:
    """Whether [`reproduction_number`][] is defined for `model`: it has
    infections, no infected compartment is infected again, and no rate reads
    the state (such rates are evaluated in the vector field only; their
    next-generation matrix would need the state's derivatives too)."""
    if model.plan.state_slots:
        return False
    try:
        infected_states(model.plan, model.stages)
    except ValueError:
        return False
    return True


# ------------------------------------------------------------------ one day
def _getter(args, u):
    def get(key: str) -> Array:
        return u[key] if u is not None and key in u else args[key]

    return get


def _per_patch(x, n: int) -> Array:
    return jnp.broadcast_to(jnp.asarray(x), (n,))


def _transfer(plan, stages, states, get, n: int) -> Array:
    """`V (patch, state, state)`: exit rates on the diagonal, minus the rates
    of transfer from column to row among infected states."""
    index = {s: i for i, s in enumerate(states)}
    rows, cols, vals = [], [], []

    def add(i, j, rate):
        rows.append(i), cols.append(j), vals.append(_per_patch(rate, n))

    for o in plan.outflows:
        k = stages[o.compartment]
        rate = get(o.rate)
        for j in range(k):
            a = index.get((o.compartment, j))
            if a is None:
                continue
            add(a, a, rate)
            if j < k - 1:
                if (b := index.get((o.compartment, j + 1))) is not None:
                    add(b, a, -rate)
                continue
            taken = 0.0
            for br in o.branches:
                if br.kind == "all":
                    r = rate
                elif br.kind == "rate":
                    r = get(br.slot)
                elif br.kind == "probability":
                    r = get(br.slot) * rate
                    taken = taken + get(br.slot)
                else:  # the remainder of a probability split
                    r = (1.0 - taken) * rate
                if (b := index.get((br.target, 0))) is not None:
                    add(b, a, -r)
    for r in plan.removals:  # deaths to outside leave every stage
        for j in range(stages[r.compartment]):
            if (a := index.get((r.compartment, j))) is not None:
                add(a, a, get(r.rate))
    m = len(states)
    V = jnp.zeros((n, m, m), jnp.result_type(*vals) if vals else float)
    for i, j, v in zip(rows, cols, vals, strict=True):
        V = V.at[:, i, j].add(v)
    return V


def _weights(inf: Infection, stages, states, get, n: int) -> Array:
    """`w (patch, state)`: the weight of each infected state in the
    infectious mass of `inf` (before any population normalisation)."""
    index = {s: i for i, s in enumerate(states)}
    cols: list[Array] = [jnp.zeros((n,)) for _ in states]
    for s in inf.sources:
        k = stages[s.compartment]
        sel = range(k) if s.selection is None else s.selection
        w = 1.0 if s.weight is None else get(s.weight)
        for j in sel:
            if (a := index.get((s.compartment, j))) is not None:
                cols[a] = cols[a] + _per_patch(w, n)
    return jnp.stack(cols, axis=-1)


def _generation(plan, stages, states, get, n: int) -> Array:
    """`G (patch, infection n, infection m)`: the weighted time infectious for
    `n` of one new infection of kind `m` (`w_nᵀ V⁻¹ e_m`)."""
    index = {s: i for i, s in enumerate(states)}
    V = _transfer(plan, stages, states, get, n)
    E = np.zeros((len(states), len(plan.infections)))
    for m, inf in enumerate(plan.infections):
        if (t := index.get((inf.target, 0))) is not None:
            E[t, m] = 1.0
    X = jnp.linalg.solve(V, jnp.broadcast_to(jnp.asarray(E, V.dtype), (n, *E.shape)))
    W = jnp.stack(
        [_weights(inf, stages, states, get, n) for inf in plan.infections], axis=1
    )
    return W @ X


def _contact(inf: Infection, y, get, z: Array) -> Array:
    """New infections per patch from the infectious mass `z (patch,)`: the
    force of infection of `z` times the susceptible amount."""
    if inf.population is not None:
        z = z / get(inf.population)
    c = inf.coupling
    force = z
    if c is not None:
        coupled = coupled_mass(
            z,
            coupling_matrix(get, c),
            None if c.scale is None else get(c.scale),
            symmetrize=c.symmetrize,
            multiplier=c.multiplier,
        )
        force = coupled if c.local == 0.0 else c.local * z + coupled
    return get(inf.transmission) * force * y[inf.source].sum(axis=0)


def _apply(plan: Plan, G, y, get, v: Array) -> Array:
    """`K_r v` for `v (infection, patch)`."""
    z = jnp.einsum("pnm,mp->np", G, v)
    return jnp.stack(
        [_contact(inf, y, get, z[i]) for i, inf in enumerate(plan.infections)]
    )


def _day(plan, stages, states, method, y, args, u) -> tuple[Array, Array]:
    """`(R per patch, R total)` on one day."""
    n = next(iter(y.values())).shape[-1]
    shape = (len(plan.infections), n)

    def operator(y, args, u):
        get = _getter(args, u)
        G = _generation(plan, stages, states, get, n)
        return lambda v: _apply(plan, G, y, get, v)

    apply = operator(y, args, u)
    state = jnp.result_type(*jtu.tree_leaves(y))
    dtype = jax.eval_shape(apply, jax.ShapeDtypeStruct(shape, state)).dtype
    _, transpose = jax.vjp(apply, jnp.zeros(shape, dtype))
    cols = jnp.stack(
        [transpose(jnp.zeros(shape, dtype).at[i].set(1.0))[0] for i in range(shape[0])]
    )  # cols[n, m, p]: new infections of kind n from one of kind m in p
    if shape[0] == 1:
        patch = cols[0, 0]
    else:  # each patch's (n, m) block
        blocks = jnp.moveaxis(cols, -1, 0)
        if has_eig():
            patch = jnp.max(jnp.real(jnp.linalg.eigvals(blocks)), -1)
        else:
            patch = jax.vmap(lambda k: root_noda(k, dtype))(blocks)
    if method == "auto":
        size = shape[0] * n
        dense = "dense" if has_eig() else "noda"
        method = dense if size <= DENSE_MAX else "noda" if size <= NODA_MAX else "power"
    if method == "dense":
        total = radius_dense(apply, shape)
    elif method == "noda":
        total = radius_noda(apply, shape, dtype)
    elif method == "power":
        frozen = jtu.tree_map(jax.lax.stop_gradient, (y, args, u))
        total = radius_power(apply, operator(*frozen), shape, dtype)
    else:
        raise ValueError(
            f"method must be 'auto', 'dense', 'noda' or 'power'; got {method!r}"
        )
    return patch, total


# ------------------------------------------------------------------ front doors
def reproduction_number_of(
    model, ys, args, inputs, *, ts=None, method: str = "auto"
) -> dict[str, Array]:
    """[`reproduction_number`][] from a precomputation `(args, inputs)`
    (`model.precompute`, or a forecast's assembled scenario inputs).

    Args:
        model: the `CompiledModel`.
        ys: `{compartment: (time, stages, patch)}` (flow accumulators ignored).
        args, inputs: from `model.precompute(params, covariates, ...)`.
        ts: the (concrete) times of `ys`' rows (default `0, 1, ...`); each
            row reads the inputs' value that holds at its time.
        method: `"dense"` (`eigvals` of the reduced matrix; on CPU only:
            JAX does not lower `eigvals` on a TPU), `"noda"` (Noda's
            iteration on the reduced matrix), `"power"` (power iteration,
            matrix-free) or `"auto"` (dense up to `DENSE_MAX`
            infection-patch types, Noda's iteration in its place off the
            CPU, then Noda's up to `NODA_MAX`, then power).
    """
    plan, stages = model.plan, model.stages
    infected_states(plan, stages)  # its errors, before any tracing
    if method == "dense" and not has_eig():
        raise ValueError(
            f"method='dense': JAX does not lower eigvals on this backend "
            f"({jax.default_backend()}); use 'noda', 'power' or 'auto'"
        )
    y = {c: jnp.asarray(ys[c]) for c in model.compartments}
    n_t = next(iter(y.values())).shape[0]
    ts = np.arange(n_t, dtype=np.float64) if ts is None else np.asarray(ts, float)
    if inputs is None:
        u = None
    else:
        idx = np.searchsorted(np.asarray(inputs.times), ts, side="right") - 1
        idx = np.clip(idx, 0, len(inputs.times) - 1)
        u = jtu.tree_map(lambda a: a[idx], inputs.values)

    run = _compiled(plan, tuple(stages.items()), method)
    patch, total = run(y, args, u)
    return {"R_eff": patch, "R_eff_total": total}


@functools.lru_cache(maxsize=16)
def _compiled(plan: Plan, stages: tuple[tuple[str, int], ...], method: str):
    """`(y, args, u) -> (R (time, patch), R_total (time,))`, compiled once
    per model and method."""
    states = infected_states(plan, dict(stages))

    def run(y, args, u):
        def one(y_t, u_t):
            return _day(plan, dict(stages), states, method, y_t, args, u_t)

        return jax.vmap(one)(y, u)

    return jax.jit(run)


def reproduction_number(
    model,
    ys,
    params,
    covariates: Mapping[str, Any] | None = None,
    *,
    ts=None,
    method: str = "auto",
) -> dict[str, Array]:
    """The effective reproduction number along a trajectory.

    At each time of `ys`, the next-generation matrix at that time's
    susceptible amounts and rates (see `docs/models.md`, "The reproduction
    number"): `R_eff (time, patch)`, the new infections in all patches
    caused by one new infection in the patch (a column sum of the
    next-generation matrix), and `R_eff_total (time,)`, its spectral radius
    over all patches, coupling included. Differentiable in `params` (and in
    `ys`).

    Args:
        model: a `CompiledModel`.
        ys: `{compartment: (time, stages, patch)}`, e.g. `solution.ys`.
        params: unconstrained parameters.
        covariates: the model's covariates, as for `model.precompute`.
        ts, method: see [`reproduction_number_of`][].

    Returns:
        `{"R_eff": (time, patch), "R_eff_total": (time,)}`.
    """
    n = jnp.shape(ys[model.compartments[0]])[-1]
    args, inputs = model.precompute(params, covariates, n)
    return reproduction_number_of(model, ys, args, inputs, ts=ts, method=method)


def basic_reproduction_number(
    model,
    params,
    covariates: Mapping[str, Any] | None = None,
    *,
    initial: Mapping[str, Any] | None = None,
    n_patches: int = 1,
    method: str = "auto",
) -> dict[str, Array]:
    """`R0`: the reproduction number on day 0 in a fully susceptible
    population: each patch's whole initial population (all compartments of
    `model.initial_state`) in the infections' susceptible compartments (in
    the proportions of their initial amounts, equal shares where all are 0).

    Returns:
        `{"R0": (patch,), "R0_total": ()}`.
    """
    y0 = model.initial_state(params, initial, n_patches)
    y0 = {c: y0[c] for c in model.compartments}
    total = sum(x.sum(axis=0) for x in y0.values())
    sources = list(dict.fromkeys(i.source for i in model.plan.infections))
    found = sum(y0[s].sum(axis=0) for s in sources)
    y = {c: jnp.zeros_like(x) for c, x in y0.items()}
    for s in sources:
        some = found > 0
        part = y0[s].sum(axis=0) / jnp.where(some, found, 1)
        share = jnp.where(some, part, 1 / len(sources))
        y[s] = y[s].at[0].set(share * total)
    ys = {c: x[None] for c, x in y.items()}
    out = reproduction_number(model, ys, params, covariates, method=method)
    return {"R0": out["R_eff"][0], "R0_total": out["R_eff_total"][0]}
