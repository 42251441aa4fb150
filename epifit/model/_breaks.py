"""Break days: the days on which a model's per-day inputs can change.

`precompute` evaluates the time-varying rates for every day into a
`PiecewiseConstant`, and each of its times is a segment boundary of the
solve, where an adaptive solver restarts (a fresh first-same-as-last stage;
where the boundary is not a save time, also a clipped step). A school-term
covariate changes on 6 days a year, weekly pieces once a week: merged onto
those days, the solver restarts only there.

The break days are concrete (NumPy): [`break_days`][] reads them from
concrete data (the covariates a `Problem` is built with) and the model's
structure. The per-day inputs themselves are traced (they depend on the
parameters, and the covariates enter solves as traced data), so
[`on_breaks`][], which `precompute(..., breaks=...)` runs, evaluates the
inputs on the break days only and checks at run time that every traced
covariate they read is constant between breaks (NaN equal to NaN), raising
a `ValueError` that names the covariate and the day where it is not. The
structure (time-varying parameters, a neural sub-model's time input) is
checked at trace time. Where nothing concrete is known, the daily grid
stays: it is always right.

Cost: `break_days` is one NumPy comparison of each covariate with itself a
day later; the guard is one gather and one comparison of each checked
covariate per solve, outside the solver loop.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from epifit.model._coupling import SparseCoupling
from epifit.model._plan import Plan
from epifit.model._spec import ModelSpec
from epifit.ode import raise_at_run_time

__all__ = ["break_days", "check_breaks", "on_breaks"]


class Sources(NamedTuple):
    """What the per-day inputs of a plan read, by kind."""

    covariates: tuple[str, ...]  # time-varying covariates
    parameters: tuple[str, ...]  # time-varying parameters (`per_time`)
    neural: tuple[str, ...]  # neural sub-models


def per_day_sources(spec: ModelSpec, plan: Plan) -> Sources:
    """The time-varying covariates, parameters and neural sub-models that the
    per-day inputs of `plan` read: the names of its slots (a neural
    sub-model reads its covariate) and the time-varying couplings (both
    matrices of a `kron(M, C)`)."""
    names = {n for s in plan.slots for e in s.expressions for n in e.names}
    neural = tuple(n.name for n in spec.neural if n.name in names)
    read = names | {n.covariate for n in spec.neural if n.name in neural}
    for inf in plan.infections:
        c = inf.coupling
        if c is not None and c.time_varying:
            read.add(c.covariate)
        if c is not None and c.contacts_time_varying:  # C of kron(M, C)
            read.add(c.contacts)
    covariates = tuple(c.name for c in spec.covariates if c.time_varying)
    parameters = tuple(p.name for p in spec.parameters if p.per_time is not None)
    return Sources(
        tuple(c for c in covariates if c in read),
        tuple(p for p in parameters if p in names),
        neural,
    )


def break_days(model, covariates: Mapping[str, Any], n_days: int):
    """The days on which the per-day inputs of `model` (a `CompiledModel`,
    bound to its days when it has time-varying parameters) can change over
    `n_days` days with these concrete covariates, as a sorted tuple of ints
    starting at 0; `None` where they may change on every day or where a
    covariate is not concrete (then the daily grid stays).

    A day is a break where a covariate the inputs read differs from the day
    before in any element (NaN equal to NaN; past its last day a covariate
    carries its last day forward), where a piece of a time-varying parameter
    starts, and on every day for a spline, a Fourier series or a neural
    sub-model with `time_input`. Pass the result to `precompute(...,
    breaks=...)` (as `Problem.solve` does)."""
    spec = model.spec
    src = per_day_sources(spec, model.plan)
    if not any(src):
        return None
    if any(n.time_input for n in spec.neural if n.name in src.neural):
        return None
    days = {0}
    span = int(n_days)
    per_time = {p.name: p.per_time for p in spec.parameters}
    for name in src.parameters:
        basis = per_time[name]
        if basis.kind != "pieces":
            return None
        horizon = model.days if model.days is not None else int(n_days)
        days |= set(range(0, horizon, basis.days))
    for name in src.covariates:
        if name not in covariates:
            raise ValueError(
                f"break_days: no covariate {name!r} given; found: "
                f"{', '.join(map(repr, covariates)) or 'none'}"
            )
        a = covariates[name]
        v = a.values if isinstance(a, SparseCoupling) else a
        if isinstance(v, jax.core.Tracer):
            return None
        v = np.asarray(v)
        span = max(span, v.shape[0])
        days |= set(_change_days(v).tolist())
    if len(days) >= span:
        return None
    return tuple(sorted(int(d) for d in days))


def _change_days(v: np.ndarray) -> np.ndarray:
    """The days `d >= 1` on which `v (time, ...)` differs from day `d - 1`."""
    if v.shape[0] < 2:
        return np.zeros(0, np.int64)
    a, b = v[1:], v[:-1]
    same = a == b
    if np.issubdtype(v.dtype, np.inexact):
        same |= np.isnan(a) & np.isnan(b)
    axes = tuple(range(1, v.ndim))
    return np.nonzero(~np.all(same, axis=axes))[0] + 1


def check_breaks(breaks) -> np.ndarray:
    """`breaks` as a NumPy int array, checked: concrete, 1-D, strictly
    increasing whole days starting at 0."""
    if isinstance(breaks, jax.core.Tracer):
        raise TypeError(
            "breaks must be concrete days (a tuple of ints): the segment grid is "
            "built at trace time; got a traced array"
        )
    b = np.asarray(breaks)
    ok = b.ndim == 1 and b.size > 0 and np.issubdtype(b.dtype, np.integer)
    if not ok or b[0] != 0 or np.any(np.diff(b) <= 0):
        raise ValueError(
            "breaks must be strictly increasing whole days starting at 0, e.g. "
            f"(0, 94, 109); got {_show(breaks)}"
        )
    return b.astype(np.int64)


def _show(x) -> str:
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."


def on_breaks(
    spec: ModelSpec,
    plan: Plan,
    arrays: Mapping[str, Any],
    daily: Mapping[str, Any] | None,
    breaks,
    n_days: int,
    horizon: int | None = None,
):
    """`(arrays, daily, days)` on the break days: the time-varying covariates
    the inputs read and the time-varying parameters' daily values at the
    days `breaks` (those below `n_days`) and those days, or everything unchanged with
    `arange(n_days)` where the breaks are every day. `horizon` is the days
    the time-varying parameters are bound to (their pieces' span).

    Raises:
        ValueError: at trace time, where an input read varies on every day
            (a spline or Fourier parameter, a neural `time_input`) or a piece
            of a time-varying parameter starts on a day that is not a break;
            at run time (under `jit`, from a callback) where a covariate the
            inputs read changes on a day that is not a break.
    """
    b = check_breaks(breaks)
    b = b[b < n_days]
    if b.size == n_days:
        return arrays, daily, np.arange(n_days)
    src = per_day_sources(spec, plan)
    _check_structure(spec, src, b, n_days, n_days if horizon is None else horizon)
    start = b[np.searchsorted(b, np.arange(n_days), side="right") - 1]
    # Only what the inputs read is gathered, and all of it is checked; a
    # covariate left daily that reached the inputs would fail loudly
    # (`PiecewiseConstant` wants len(breaks) rows). An unread neural
    # sub-model's covariate is gathered unchecked: its rates go nowhere.
    unread = {n.covariate for n in spec.neural} - set(src.covariates)
    out = dict(arrays)
    checked = {}
    for c in spec.covariates:
        if not c.time_varying or c.name not in {*src.covariates, *unread}:
            continue
        a = arrays[c.name]
        v = a.values if isinstance(a, SparseCoupling) else a
        if c.name in src.covariates:
            checked[c.name] = _changes_off_breaks(v, start)
        v = v[b]
        sparse = isinstance(a, SparseCoupling)
        out[c.name] = SparseCoupling(v, a.columns) if sparse else v
    out = _raise_if_changed(out, checked, b, spec.path)
    daily = None if daily is None else {k: v[b] for k, v in daily.items()}
    return out, daily, b


def _check_structure(
    spec: ModelSpec, src: Sources, b: np.ndarray, n_days: int, horizon: int
) -> None:
    """Trace-time checks of the inputs whose changes the model's structure
    fixes: time-varying parameters and a neural sub-model's time input."""
    neural = {n.name: n for n in spec.neural}
    for name in src.neural:
        if neural[name].time_input:
            raise ValueError(
                f"neural sub-model {name!r} reads the day (time_input = true), so "
                "its rates change every day and cannot be merged onto break "
                "days; solve on the daily grid (breaks=None)"
            )
    per_time = {p.name: p.per_time for p in spec.parameters}
    for name in src.parameters:
        basis = per_time[name]
        if basis.kind != "pieces":
            raise ValueError(
                f"time-varying parameter {name!r} ({basis.kind}) changes every day "
                "and cannot be merged onto break days; solve on the daily grid "
                "(breaks=None)"
            )
        # day d is in piece min(d // days, K - 1), K = ceil(horizon / days)
        starts = np.arange(0, min(horizon, n_days), basis.days)
        missing = np.setdiff1d(starts, b)
        if missing.size:
            raise ValueError(
                f"a piece of time-varying parameter {name!r} starts on day "
                f"{int(missing[0])}, which is not a break day; include every "
                f"piece start (multiples of {basis.days} below {horizon}) in breaks"
            )


def _changes_off_breaks(v, start: np.ndarray):
    """The first day on which `v (time, ...)` differs from its value on the
    break day that starts its piece (NaN equal to NaN), or -1 if none."""
    ref = jnp.take(v, jnp.asarray(start), axis=0)
    same = v == ref
    if jnp.issubdtype(v.dtype, jnp.inexact):
        same = same | (jnp.isnan(v) & jnp.isnan(ref))
    off = ~jnp.all(same.reshape(same.shape[0], -1), axis=1)
    return jnp.where(jnp.any(off), jnp.argmax(off), -1)


def _raise_if_changed(out, checked: Mapping[str, Any], b: np.ndarray, path):
    """`out`, after raising (now if concrete, else at run time from a
    callback) naming the first covariate of `checked` that changes on a day
    not in `b`."""
    if not checked:
        return out
    names = list(checked)

    def check(*days):
        # one array per covariate: a scalar, or one day per dataset under vmap
        for name, d in zip(names, days, strict=True):
            d = np.ravel(np.asarray(d))
            if np.any(d >= 0):
                raise ValueError(_message(name, int(d[d >= 0][0]), b, path))

    days = [checked[n] for n in names]
    if not any(isinstance(d, jax.core.Tracer) for d in days):
        check(*days)
        return out
    # a host callback in a `cond`, tied to `out` (no side effect in the
    # program; see `epifit.ode.raise_at_run_time`)
    bad = jnp.any(jnp.stack([d >= 0 for d in days]))
    return raise_at_run_time(out, bad, check, *days)


def _message(name: str, day: int, b: np.ndarray, path) -> str:
    where = f" of model {path}" if path else ""
    return (
        f"covariate {name!r}{where} changes on day {day}, which is not one of the "
        f"{b.size} break days its per-day inputs were merged onto (computed from "
        "the covariates the Problem was built with, or given as "
        "precompute(breaks=...)); solve with covariates that change on those "
        "days only, or on the daily grid (Problem.breaks = None, breaks=None)"
    )
