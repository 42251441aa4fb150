"""What a compiled model evaluates once per solve, before integration.

Covariates are checked against their declared dims (`covariate_arrays`); then
every rate slot of the plan is evaluated: a static slot once into `args`, a
time-varying one for every day at once (`vmap` over the day axis) into the
per-day inputs, with the neural sub-models' rates `(time, patch)` and the
coupling matrices beside them. Cost: one MLP evaluation per (day, patch) and
one slot evaluation per day, all outside the solver loop; the right-hand side
then only reads them.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike

from epifit._custom_types import Args
from epifit._schema import FEATURE, PATCH, PATCH_TO, TIME
from epifit._toml import join
from epifit.model._breaks import on_breaks
from epifit.model._coupling import SparseCoupling
from epifit.model._errors import ModelSpecError
from epifit.model._neural import neural_rates
from epifit.model._plan import Plan, Slot
from epifit.model._spec import ModelSpec
from epifit.model._state import put_state_names
from epifit.model._strata import check_kron_sizes, kron_operands
from epifit.ode import PiecewiseConstant

__all__ = ["args_and_inputs", "covariate_arrays", "day_rule"]


def day_rule(spec: ModelSpec) -> str | None:
    """The day lookup rule of the time-varying covariates (`None` if none)."""
    rules = {c.rule for c in spec.covariates if c.time_varying}
    return rules.pop() if rules else None


def covariate_arrays(
    spec: ModelSpec, params: Mapping[str, Any], covariates: Mapping[str, ArrayLike]
) -> tuple[dict[str, Array], int | None, int | None]:
    """Check covariate shapes against their dims; return arrays, patches, days."""
    sizes: dict[str, tuple[int, str]] = {}

    def fail(location: str, reason: str) -> ModelSpecError:
        return ModelSpecError(reason, file=spec.path, location=location)

    def agree(dim: str, size: int, where: str) -> None:
        if dim in sizes and sizes[dim][0] != size:
            raise fail(
                where,
                f"{dim} size {size} disagrees with {dim} size {sizes[dim][0]} of "
                f"{sizes[dim][1]}",
            )
        sizes.setdefault(dim, (size, where))

    for p in spec.parameters:
        if p.per_patch and p.name in params and spec.strata is None:
            agree(PATCH, int(jnp.shape(params[p.name])[-1]), f"parameters.{p.name}")
    in_sizes = {
        n.covariate: (n.in_size - int(n.time_input), n.name) for n in spec.neural
    }
    arrays = {}
    kron, kron_patches = kron_operands(spec), None
    for c in spec.covariates:
        loc = f"covariates.{c.name}"
        if c.name not in covariates:
            raise fail(loc, f"no covariate {c.name!r} given; found: {join(covariates)}")
        a = covariates[c.name]
        if not isinstance(a, SparseCoupling):
            a = jnp.asarray(a)
        elif c.dims[-1] != PATCH_TO or kron.get(c.name) == "stratum":
            raise fail(loc, "a sparse matrix is only a coupling covariate")
        if a.ndim != len(c.dims):
            raise fail(
                loc, f"shape {a.shape} does not match dims ({', '.join(c.dims)})"
            )
        if c.name in kron:  # an operand of kron(M, C), on its own axis
            S, why = spec.strata.size, functools.partial(fail, loc)
            n = check_kron_sizes(kron[c.name], a.shape, S, why)
            kron_patches = (n, loc) if n is not None else kron_patches
            if TIME in c.dims:
                agree(TIME, a.shape[0], loc)
            arrays[c.name] = a
            continue
        for dim, size in zip(c.dims, a.shape, strict=True):
            if dim == FEATURE:
                want, by = in_sizes[c.name]
                if size != want:
                    raise fail(
                        loc,
                        f"shape {a.shape}: {size} features, but neural sub-model "
                        f"{by!r} takes {want}",
                    )
            elif dim == PATCH_TO:
                agree(PATCH, size, loc)
            elif dim == TIME and size < 1:
                raise fail(loc, f"shape {a.shape} has no days")
            else:
                agree(dim, size, loc)
        arrays[c.name] = a
    if kron_patches is not None:  # M's patches times the strata: the cells
        n, loc = kron_patches
        S = spec.strata.size
        if PATCH in sizes and sizes[PATCH][0] != n * S:
            cells, where = sizes[PATCH]
            raise fail(
                loc,
                f"{n} patches x {S} strata are {n * S} cells, but {where} has "
                f"{cells} cells",
            )
        sizes.setdefault(PATCH, (n * S, loc))
    n_patches = sizes[PATCH][0] if PATCH in sizes else None
    n_days = sizes[TIME][0] if TIME in sizes else None
    return arrays, n_patches, n_days


def args_and_inputs(
    spec: ModelSpec,
    plan: Plan,
    values: Mapping[str, Any],
    arrays: Mapping[str, Array],
    n_days: int | None,
    n_patches: int | None,
    daily: Mapping[str, Array] | None = None,
    breaks=None,
    horizon: int | None = None,
) -> tuple[Args, PiecewiseConstant | None]:
    """`(args, inputs)` of [`CompiledModel.precompute`][epifit.model.CompiledModel]
    from the constrained `values`, the checked covariate `arrays` and the
    daily values of the time-varying parameters (`daily`, `(day[, patch])`
    over `n_days` days; time-varying covariates with fewer days carry their
    last day forward to `n_days`). With `breaks` (concrete days), the
    per-day inputs are evaluated on those days only and hold until the next
    (`_breaks.on_breaks`, which checks that nothing read changes between)."""
    static_env = dict(values)
    if daily:
        arrays = _carry_days(spec, arrays, n_days)
    grid = None if n_days is None else np.arange(n_days)
    if breaks is not None and n_days is not None:
        arrays, daily, grid = on_breaks(
            spec, plan, arrays, daily, breaks, n_days, horizon
        )
    day_env: dict[str, Array] = dict(daily or {})
    for c in spec.covariates:
        if c.dims == (PATCH,):
            static_env[c.name] = arrays[c.name]
        elif c.dims in ((TIME,), (TIME, PATCH)):
            day_env[c.name] = arrays[c.name]
    days = None if grid is None else jnp.asarray(grid)
    for n in spec.neural:
        day_env[n.name] = neural_rates(n, values[n.name], arrays[n.covariate], days)
    args: dict[str, Array] = {}
    per_day: dict[str, Array] = {}
    for s in plan.slots:
        if s.state:  # evaluated in the vector field, from y
            continue
        if s.time_varying:
            names = {n for e in s.expressions for n in e.names} & day_env.keys()
            today = {n: day_env[n] for n in names}

            def evaluate(today, s=s):
                return _slot_value(s, {**static_env, **today})

            per_day[s.key] = jax.vmap(evaluate)(today)
        else:
            value = _slot_value(s, static_env)
            if n_patches is not None and jnp.ndim(value) == 0:
                value = jnp.broadcast_to(value, (n_patches,))
            args[s.key] = value
    put_state_names(plan, static_env, day_env, args, per_day)
    for inf in plan.infections:
        c = inf.coupling
        if c is not None:
            m = arrays[c.covariate]
            if isinstance(m, SparseCoupling):
                # the columns hold on every day; only the weights vary
                args[c.matrix + ".columns"] = m.columns
                m = m.values
            (per_day if c.time_varying else args)[c.matrix] = m
            if c.contacts is not None:  # C of kron(M, C)
                daily = per_day if c.contacts_time_varying else args
                daily[c.contacts_key] = arrays[c.contacts]
    if not per_day:
        return args, None
    times = grid.astype(np.float64)
    if day_rule(spec) == "nearest":
        times = times - 0.5
    return args, PiecewiseConstant(times, per_day)


def _carry_days(spec: ModelSpec, arrays, n_days: int) -> dict[str, Array]:
    """The time-varying covariates extended to `n_days` days by repeating
    their last day (what `PiecewiseConstant` does past its last time)."""
    out = dict(arrays)
    for c in spec.covariates:
        if not c.time_varying:
            continue
        a = arrays[c.name]
        v = a.values if isinstance(a, SparseCoupling) else a
        if v.shape[0] < n_days:
            last = jnp.broadcast_to(v[-1:], (n_days - v.shape[0], *v.shape[1:]))
            v = jnp.concatenate([v, last])
            sparse = isinstance(a, SparseCoupling)
            out[c.name] = SparseCoupling(v, a.columns) if sparse else v
    return out


def _slot_value(slot: Slot, env: Mapping[str, Any]) -> Array:
    total = None
    for e in slot.expressions:
        v = e.evaluate(env)
        total = v if total is None else total + v
    if slot.factor != 1.0:
        total = slot.factor * total
    return total
