"""Ensembles: parameter samples x scenarios through one compiled, vmapped solve.

A scenario is data ([`BoundScenarios.data`][]), so every scenario runs
through the same executable: one compilation per forecast configuration,
`vmap` over a chunk of parameter samples, a Python loop over chunks and
scenarios.

**Time-limited parameter changes.** Parameters are constant within a solve.
Instead of chaining solves over the intervals between change days, the rates
a changed parameter feeds (the model's *slots*: transition rates, coupling
scales, transmission expressions) are evaluated once per interval by
`precompute` and handed to the solver as per-day inputs, which are constant
on each day and change only at day boundaries, so each change day is a
segment boundary of the solve, where the solver restarts; the state is carried
across exactly as in a chained solve. This keeps one static structure for
every scenario (no recompilation per set of change days) and lets the
scenarios share the executable. A change from day `k` applies to day `k` as
the model's covariates define it: from `t = k` (`floor` rule, or no
time-varying covariates), from `t = k - 1/2` (`nearest` rule).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.flatten_util import ravel_pytree

from epifit._stored import stored
from epifit._vmap import vmap_batch
from epifit.model import (
    STATE_NAMES,
    CompiledModel,
    derived_series,
    has_reproduction_number,
    reproduction_number_of,
    unconstrain,
)
from epifit.ode import AbstractSolver, AbstractStepSizeController, PiecewiseConstant
from epifit.simulation import ModelRun, SolverSettings, period_sums

__all__ = [
    "EnsembleConfig",
    "draw_samples",
    "iter_ensemble",
    "param_template",
    "run_ensemble",
]

# the reproduction number's series (see `EnsembleConfig.reproduction`)
REFF, REFF_TOTAL = "R_eff", "R_eff_total"

# host memory for one chunk of samples, used to choose the chunk size
CHUNK_BUDGET_BYTES = 512 * 2**20
# on CPU: state elements (samples x compartment stages x patches) per chunk
CPU_CHUNK_STATE = 6000


class _Static:
    """The non-array leaves of a parameter pytree (activation functions of
    neural sub-models), hashable so the configuration can key a cache."""

    def __init__(self, tree: Any):
        self.tree = tree
        leaves, self.treedef = jtu.tree_flatten(tree)
        self.leaves = tuple(leaves)

    def __hash__(self) -> int:
        return hash((self.treedef, self.leaves))

    def __eq__(self, other) -> bool:
        return (
            isinstance(other, _Static)
            and self.treedef == other.treedef
            and self.leaves == other.leaves
        )


def param_template(model: CompiledModel, params) -> tuple[tuple[Any, Any], _Static]:
    """Split a parameter pytree into `(free, rest)` arrays (traced) and its
    static leaves: the free vector `x` is `ravel_pytree(free)`, in the order
    of a fit's free labels."""
    free, rest = eqx.partition(params, model.free_mask(params))
    rest_arrays, static = eqx.partition(rest, eqx.is_array)
    return (free, rest_arrays), _Static(static)


@dataclasses.dataclass(frozen=True)
class EnsembleConfig:
    """Everything static about an ensemble run (hashable: it keys the cache of
    compiled functions, so forecasts of the same shape compile once).

    Attributes:
        model: the compiled model.
        n_patches, n_days: sizes (the cells of a model with `[strata]`); the
            solve saves days `0 .. n_days - 1`.
        interval_of_day: the parameter interval of each day.
        parameters: the parameters scenarios change.
        transmission: whether scenarios change transmission.
        observations: observed series to return (model predictions).
        compartments: compartments to return (summed over stages).
        solver, controller, max_steps: the solve.
        dtype: the floating dtype.
        static: the static leaves of the parameter pytree.

    With infections (`reproduction`), each trajectory also returns `R_eff
    (time, patch)` and `R_eff_total` (as `(time, 1)`) at the scenario's
    rates (`epifit.model.reproduction_number_of`); and every derived series
    (`derived`) `(time, patch)`, at the scenario's parameters and
    covariates (`epifit.model.derived_series`).
    """

    model: CompiledModel
    n_patches: int
    n_days: int
    interval_of_day: tuple[int, ...]
    parameters: tuple[str, ...]
    transmission: bool
    observations: tuple[str, ...]
    compartments: tuple[str, ...]
    solver: AbstractSolver
    controller: AbstractStepSizeController
    max_steps: int
    dtype: str
    static: _Static

    @functools.cached_property
    def settings(self) -> SolverSettings:
        """The solve's settings: `solver`, `controller` and `max_steps`."""
        return SolverSettings(
            solver=self.solver,
            stepsize_controller=self.controller,
            max_steps=self.max_steps,
        )

    @functools.cached_property
    def reproduction(self) -> bool:
        return has_reproduction_number(self.model)

    @property
    def derived(self) -> tuple[str, ...]:
        """The model's derived series (`[derived]` reading the state or
        covariates)."""
        return tuple(d.name for d in self.model.spec.series)

    @property
    def levels(self) -> tuple[str, ...]:
        """`("R_eff",)` when the ensemble returns the reproduction number."""
        return (REFF,) if self.reproduction else ()

    @property
    def n_intervals(self) -> int:
        return self.interval_of_day[-1] + 1

    @functools.cached_property
    def affected(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Keys of the static and time-varying slots that read a changed
        parameter (directly or through derived quantities)."""
        spec = self.model.spec
        names = set(self.parameters)
        deps = {d.name: set(d.expression.names) for d in spec.derived}
        grew = True
        while grew:
            grew = False
            for d, needs in deps.items():
                if d not in names and needs & names:
                    names.add(d)
                    grew = True
        static, varying = [], []
        for s in self.model.plan.slots:
            used = {n for e in s.expressions for n in e.names}
            if used & names and s.state:  # evaluated in the vector field, which
                # reads the names it uses (STATE_NAMES + name) from args/inputs
                static += [STATE_NAMES + n for n in sorted(used & names)]
            elif used & names:
                (varying if s.time_varying else static).append(s.key)
        return tuple(dict.fromkeys(static)), tuple(varying)

    @property
    def transmission_keys(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(i.transmission for i in self.model.plan.infections))

    @property
    def first_rows(self) -> dict[str, int]:
        """The first day with a value of each observed series: 1 for an
        amount over a day, `period - 1` more for a sum over a period."""
        return {
            o.name: o.first_day + o.period - 1 for o in self.model.spec.observations
        }


# ----------------------------------------------------------------- one sample
def _modify(cfg: EnsembleConfig, params, changes, j: int):
    """The parameters of interval `j`: scaled or replaced on the constrained
    scale (clipped to the bounds), unchanged entries left bit-for-bit. A
    time-varying parameter's `value` replaces its coefficients here; its
    `scale` multiplies its daily values (`_daily_scale`)."""
    values = cfg.model.constrain(params)
    specs = {p.name: p for p in cfg.model.spec.parameters}
    out = dict(params)
    for name in cfg.parameters:
        p = specs[name]
        scale, value = changes[name]["scale"][j], changes[name]["value"][j]
        if p.per_time is not None:
            out[name] = _replace_coefficients(cfg.model, p, params[name], value)
            continue
        keep = jnp.isnan(value)
        target = jnp.where(keep, scale * values[name], value)
        lo, hi = p.bounds
        target = jnp.clip(target, lo, hi)
        new = unconstrain(p.transform, target, lo, hi).astype(params[name].dtype)
        out[name] = jnp.where(keep & (scale == 1.0), params[name], new)
    return out


def _daily_scale(cfg: EnsembleConfig, changes, j: int) -> dict[str, Any] | None:
    """The factors of the daily values of the time-varying parameters that
    interval `j` scales (1 where it sets a value): every kind is scaled as a
    modeller reads it, its value on each day of the window times `scale`
    (for pieces the same as scaling each piece; a spline's or a Fourier
    series' scaled daily values are those of no coefficients)."""
    varying = {p.name for p in cfg.model.spec.parameters if p.per_time is not None}
    out = {n: changes[n]["scale"][j] for n in cfg.parameters if n in varying}
    return out or None


def _replace_coefficients(model: CompiledModel, p, x, value):
    """The coefficients of a time-varying parameter whose daily value is
    replaced by `value` (`()` or `(patch,)`: constant coefficients); NaN
    keeps."""
    lo, hi = p.bounds
    keep = jnp.broadcast_to(jnp.isnan(value), x.shape)
    inside = float(np.ravel(np.asarray(p.value, np.float64))[0])
    safe = jnp.where(jnp.isnan(value), inside, jnp.clip(value, lo, hi))
    replaced = model.coefficients_at(p.name, safe)
    return jnp.where(keep, x, replaced.astype(x.dtype))


def _assemble(cfg: EnsembleConfig, pre, data):
    """One `(args, inputs)` from the per-interval precomputations: the slots
    that differ between intervals (and a changed transmission) become per-day
    inputs."""
    args0, inputs0 = pre[0]
    T = cfg.n_days
    static_keys, varying_keys = cfg.affected if len(pre) > 1 else ((), ())
    if not (static_keys or varying_keys or cfg.transmission):
        return args0, inputs0
    idx = np.asarray(cfg.interval_of_day)
    days = np.arange(T)
    values = {} if inputs0 is None else dict(inputs0.values)
    times = np.arange(T, dtype=np.float64) if inputs0 is None else inputs0.times
    for key in static_keys:
        if key not in args0:  # a name a state rate reads, per day already
            values[key] = jnp.stack([inp.values[key] for _, inp in pre])[idx, days]
            continue
        values[key] = jnp.stack([a[key] for a, _ in pre])[idx]
    for key in varying_keys:
        values[key] = jnp.stack([inp.values[key] for _, inp in pre])[idx, days]
    if cfg.transmission:
        tr = data["transmission"]
        for key in cfg.transmission_keys:
            if key in values:
                v = values[key]
            else:
                v = jnp.broadcast_to(args0[key], (T, *jnp.shape(args0[key])))
            if v.ndim == 1:
                v = v[:, None]
            values[key] = jnp.where(
                jnp.isnan(tr["value"]), tr["scale"] * v, tr["value"]
            ).astype(v.dtype)
    args = {k: v for k, v in args0.items() if k not in values}
    return args, PiecewiseConstant(times, values)


def _select(cfg: EnsembleConfig, per_interval: list) -> jnp.ndarray:
    """Rows of a `(time, patch)` series, each from its day's interval."""
    if len(per_interval) == 1:
        return per_interval[0]
    rows = per_interval[0].shape[0]
    idx = np.asarray(cfg.interval_of_day)[:rows]
    return jnp.stack(per_interval)[idx, np.arange(rows)]


def trajectory(cfg: EnsembleConfig, x, template, data) -> tuple[dict, jnp.ndarray]:
    """One sample in one scenario: `{series: (time, patch)}` (incidence with
    NaN on day 0) and the solver's result code."""
    model, n, T = cfg.model, cfg.n_patches, cfg.n_days
    free, rest = template
    _, unravel = ravel_pytree(free)
    params = eqx.combine(unravel(x), rest, cfg.static.tree)
    if cfg.parameters:
        changes = data["parameters"]
        plist = [_modify(cfg, params, changes, j) for j in range(cfg.n_intervals)]
        scales = [_daily_scale(cfg, changes, j) for j in range(cfg.n_intervals)]
    else:
        plist, scales = [params], [None]
    cov = data["covariates"]
    run = ModelRun(model, np.arange(T, dtype=np.float64), n, cfg.dtype, cfg.settings)
    y0 = run.initial_state(plist[0], data["initial"], cov)
    pre = [run.precompute(p, cov, sc) for p, sc in zip(plist, scales, strict=True)]
    args, inputs = _assemble(cfg, pre, data)
    sol = run.integrate(y0, args, inputs, throw=False)
    out = {}
    if cfg.observations:
        weekday = data.get("weekday")
        preds = [model.observe(sol.ys, p, cov, weekday=weekday) for p in plist]
        periods = {o.name: o.period for o in model.spec.observations}
        for name in cfg.observations:
            s = period_sums(_select(cfg, [pr[name] for pr in preds]), periods[name])
            if s.shape[0] == T - 1:  # (time, patch), or per cell with strata
                s = jnp.concatenate([jnp.full((1, s.shape[1]), jnp.nan, s.dtype), s])
            out[name] = s
    for c in cfg.compartments:
        out[c] = sol.ys[c].sum(axis=1)
    if cfg.reproduction:
        r = reproduction_number_of(model, sol.ys, args, inputs, ts=run.ts)
        out[REFF] = r[REFF].astype(cfg.dtype)
        out[REFF_TOTAL] = r[REFF_TOTAL][:, None].astype(cfg.dtype)
    if cfg.derived:  # each day at its interval's parameters
        per = [derived_series(model, sol.ys, p, cov) for p in plist]
        for name in cfg.derived:
            out[name] = _select(cfg, [d[name] for d in per]).astype(cfg.dtype)
    return out, sol.result


@functools.lru_cache(maxsize=8)
def _compiled(cfg: EnsembleConfig) -> Callable:
    def one(x, template, data):
        return trajectory(cfg, x, template, data)

    # jitted, and kept across CLI runs with the same inputs (`epifit._stored`)
    batched = vmap_batch(one, in_axes=(0, None, None))
    # (one per configuration: the store tells them apart by the order in
    # which a run calls them; their reprs hold sets, whose order varies)
    return stored("forecast ensemble", batched, out_tree=None)


# -------------------------------------------------------------------- samples
def draw_samples(
    x: np.ndarray, covariance: np.ndarray | None, n: int, *, seed: int
) -> np.ndarray:
    """`n` draws of the free vector from `Normal(x, covariance)`, seeded
    (`numpy.random.default_rng(seed)`), shape `(n, len(x))`.

    The covariance is factored by its eigendecomposition (negative round-off
    eigenvalues set to 0), so a singular one (a parameter pinned) works.

    Raises:
        ValueError: draws asked for without a usable covariance.
    """
    x = np.asarray(x, np.float64)
    if n == 0:
        return np.zeros((0, x.size))
    if covariance is None:
        raise ValueError(
            "The fit has no covariance (it was calibrated without uncertainty); "
            "recalibrate with uncertainty, or forecast with samples=0 (the point "
            "estimate only)."
        )
    cov = np.asarray(covariance, np.float64)
    if cov.shape != (x.size, x.size):
        raise ValueError(
            f"covariance has shape {cov.shape}; the free vector has {x.size} entries"
        )
    if not np.all(np.isfinite(cov)):
        raise ValueError(
            "The fit's covariance is not finite (some parameters are not identified "
            "by the data, or the noise variance could not be estimated); fix or "
            "drop those parameters and recalibrate, or forecast with samples=0."
        )
    w, V = np.linalg.eigh(0.5 * (cov + cov.T))
    factor = V * np.sqrt(np.clip(w, 0.0, None))
    z = np.random.default_rng(seed).standard_normal((n, x.size))
    return x + z @ factor.T


# ------------------------------------------------------------------------ run
def default_chunk(cfg: EnsembleConfig, n: int, backend: str | None = None) -> int:
    """Samples per compiled call.

    Always within `CHUNK_BUDGET_BYTES` of trajectories (and the solver's
    saved states) per chunk. On CPU, also about `CPU_CHUNK_STATE` state
    elements per chunk: a vmapped adaptive solve runs each segment until its
    slowest sample is done and selects the whole carry at every step, which
    pays only while the per-step work of a sample is small (the constant
    comes from `benchmarks/forecast.py`).
    """
    state = sum(cfg.model.stages.values()) * cfg.n_patches
    series = len(cfg.observations + cfg.compartments + cfg.derived) + cfg.reproduction
    per_sample = 8 * cfg.n_days * (3 * state + 4 * series * cfg.n_patches)
    chunk = CHUNK_BUDGET_BYTES // max(per_sample, 1)
    if (backend or jax.default_backend()) == "cpu":
        chunk = min(chunk, CPU_CHUNK_STATE // max(state, 1))
    return int(max(1, min(n, chunk)))


def iter_ensemble(
    cfg: EnsembleConfig,
    xs: np.ndarray,
    template,
    scenarios: Iterable[Mapping[str, Any]],
    *,
    chunk_size: int | None = None,
) -> Iterator[tuple[dict[str, np.ndarray], np.ndarray]]:
    """[`run_ensemble`][], one scenario at a time (so a caller that summarises
    each scenario as it comes holds one scenario's trajectories at most)."""
    fn = _compiled(cfg)
    xs = np.asarray(xs)
    K = xs.shape[0]
    C = default_chunk(cfg, K) if chunk_size is None else int(chunk_size)
    if C < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
    C = min(C, K)
    pad = (-K) % C
    xs = np.concatenate([xs, np.repeat(xs[-1:], pad, axis=0)]) if pad else xs
    # NumPy on the host, chunks put on the device: no eager slicing programs
    xs = np.asarray(xs, cfg.dtype)
    template = jax.tree.map(_device(cfg.dtype), template)
    for data in scenarios:
        data = jax.tree.map(_device(cfg.dtype), data)
        out: dict[str, np.ndarray] = {}
        results = np.zeros(K, np.int64)
        for k in range(0, K + pad, C):
            series, result = fn(jax.device_put(xs[k : k + C]), template, data)
            n = min(C, K - k)
            for name, a in series.items():
                if name not in out:  # filled chunk by chunk: no copies
                    out[name] = np.empty((K, *a.shape[1:]), a.dtype)
                out[name][k : k + n] = np.asarray(a)[:n]
            results[k : k + n] = np.asarray(result)[:n]
        yield out, results


def run_ensemble(
    cfg: EnsembleConfig,
    xs: np.ndarray,
    template,
    scenarios: Iterable[Mapping[str, Any]],
    *,
    chunk_size: int | None = None,
) -> list[tuple[dict[str, np.ndarray], np.ndarray]]:
    """Run every sample (rows of `xs`) in every scenario.

    Args:
        cfg: the static configuration.
        xs: `(sample, free)` free vectors.
        template: `(free, rest)` from [`param_template`][].
        scenarios: per scenario, its data (`covariates`, `initial`, and
            `parameters` / `transmission` when changed); NumPy or JAX.
        chunk_size: samples per compiled call (default: [`default_chunk`][]);
            the last chunk is padded, so every call has the same shape.

    Returns:
        Per scenario, `({series: (sample, time, patch)}, results (sample,))`
        as NumPy arrays; a failed solve has result != 0 and NaN states.
    """
    return list(iter_ensemble(cfg, xs, template, scenarios, chunk_size=chunk_size))


def _device(dtype: str):
    def to(a):
        a = np.asarray(a)
        if np.issubdtype(a.dtype, np.floating):
            a = a.astype(dtype)
        return jax.device_put(a)  # not jnp.asarray: no program compiled

    return to
