"""The daily series each observation predicts from a trajectory: the observed
quantity (a level, a one-way change or a flow), then its reporting (delay,
ascertainment, scale, week effect). The likelihoods live in the data layer;
aggregation onto the data's time stamps (weekly totals) in the simulation
layer, which knows the stamps.

Cost: per observation a sum over its compartments (or one accumulator, see
`flow_key`), a difference along time, a causal convolution of `max_days + 1`
shifted copies when it has a delay, and elementwise products.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from epifit._schema import TIME
from epifit.model._delay import GammaDelay, LogNormalDelay, convolve_delay
from epifit.model._fields import WEEKDAYS
from epifit.model._spec import ObservationSpec

__all__ = ["first_day", "flow_key", "observed_flows", "quantity", "report"]

DELAYS = {"gamma": GammaDelay, "lognormal": LogNormalDelay}


def flow_key(edge: tuple[str, str]) -> str:
    """The state entry accumulating the flow along `edge`, `"S->E"`: shape
    `(1, patch)`, zero at `t = 0`, its derivative the flow (the accumulators
    are integrated beside the compartments, so a flow over an interval is
    exact to the solver's tolerance, not a difference of stocks)."""
    return f"{edge[0]}->{edge[1]}"


def observed_flows(observations) -> tuple[tuple[str, str], ...]:
    """The distinct edges the observations' flows read, in order (only these
    get accumulators: unobserved flows cost nothing)."""
    edges = [o.transition for o in observations if o.kind == "flow"]
    return tuple(dict.fromkeys(edges))


def first_day(spec: ObservationSpec) -> int:
    """The day of the first value of [`quantity`][]: 0 for a level, 1 for an
    amount over a day (row `k` is the amount over day `k -> k + 1`)."""
    return spec.first_day


def quantity(
    spec: ObservationSpec, ys: Mapping[str, Float[Array, "time stage patch"]]
) -> Float[Array, "day patch"]:
    """The observed quantity on the save grid, before reporting.

    `prevalence`: the sum of the compartments over their stages, `(time,
    patch)`. `incidence`: `sign` times its daily change, `(time - 1, patch)`
    (`sign = -1` for a decreasing compartment: new infections as `-diff(S)`).
    `flow`: the daily increase of the flow's accumulator, `(time - 1, patch)`.
    """
    if spec.kind == "flow":
        return jnp.diff(ys[flow_key(spec.transition)][:, 0, :], axis=0)
    total = None
    for name in spec.compartments:
        x = ys[name].sum(axis=-2)
        total = x if total is None else total + x
    if spec.kind == "incidence":
        total = jnp.diff(total, axis=0)
        if spec.sign == -1:
            total = -total
    return total


def report(
    spec: ObservationSpec,
    series: Float[Array, "day patch"],
    values: Mapping[str, Any],
    covariates: Mapping[str, Any] | None,
    dims: Mapping[str, tuple[str, ...]],
    weekday: Array | None,
    fail,
) -> Float[Array, "day patch"]:
    """The expected reports of a daily `series` ([`quantity`][]): delayed,
    ascertained, scaled and weighted by the day of the week, in that order.

    Args:
        values: the constrained parameters and derived quantities.
        covariates: day-major arrays by name (`dims` gives their dims); an
            ascertainment reads the day
            of each report (row `k` of an amount is reported on day `k + 1`);
            a covariate shorter than the series carries its last day forward.
        weekday: the day of the week of every day of the save grid (Monday
            0), for a week effect.
        fail: `fail(field, reason)` -> the exception to raise.
    """
    day0 = first_day(spec)
    n = series.shape[0]
    if spec.delay is not None:
        d = spec.delay
        mean, sd = d.mean.evaluate(values), d.sd.evaluate(values)
        series = convolve_delay(series, DELAYS[d.family](mean, sd, d.max_days))
    if spec.ascertainment is not None:
        env = _environment(
            spec, "ascertainment", values, covariates, dims, day0, n, fail
        )
        series = series * spec.ascertainment.evaluate(env)
    if spec.scale is not None:
        env = _environment(spec, "scale", values, covariates, dims, day0, n, fail)
        series = series * spec.scale.evaluate(env)
    if spec.week_effect is not None:
        if weekday is None:
            raise fail(
                f"observations.{spec.name}.week_effect",
                "needs the day of the week of every day: give dated data (a "
                "datetime time axis)",
            )
        log_effect = jnp.stack(
            [jnp.asarray(values[f"{spec.week_effect}_{d}"]) for d in WEEKDAYS]
        )
        days = jnp.asarray(weekday)[day0 : day0 + n]
        series = series * jnp.exp(log_effect)[days][:, None].astype(series.dtype)
    return series


def _environment(spec, field, values, covariates, dims, day0: int, n: int, fail):
    """The names an expression of `spec.field` reads, each as an array that
    broadcasts against a `(day, patch)` series: parameters `()` or `(1,
    patch)`, covariates cut to the report days `day0, ..., day0 + n - 1`."""
    env = {}
    for name in getattr(spec, field).names:
        if name in values:
            v = jnp.asarray(values[name])
            env[name] = v[None, :] if v.ndim == 1 else v
            continue
        if covariates is None or name not in covariates:
            raise fail(
                f"observations.{spec.name}.{field}",
                f"needs the covariate {name!r}; pass covariates",
            )
        env[name] = _report_days(jnp.asarray(covariates[name]), dims[name], day0, n)
    return env


def _report_days(x: Array, dims: tuple[str, ...], day0: int, n: int) -> Array:
    """Rows `day0 ... day0 + n - 1` of a day-major covariate (its last row
    repeated past its end), `(n, 1)` for a `(time,)` one, to multiply a
    `(day, patch)` series; a covariate without a time axis as it is."""
    if TIME not in dims:
        return x[None, :] if x.ndim == 1 else x
    x = x[np.minimum(np.arange(day0, day0 + n), x.shape[0] - 1)]
    return x[:, None] if x.ndim == 1 else x
