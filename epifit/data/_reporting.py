"""From model trajectories to expected reports: incidence, ascertainment, week effect.

The usual chain of renewal-model tools (EpiNow2, epinowcast), in that order:

    expected = week_effect(ascertain(convolve_delay(incidence, delay), fraction))

Each step is a pure, jitted JAX function of arrays whose leading axis is `time`,
elementwise (linear in the number of points) except the delay, which costs one
pass per day of delay (see `convolve_delay`).
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int

from epifit.model import AbstractDelay, convolve_delay


@jax.jit
def incidence(
    cumulative: Float[ArrayLike, " time *rest"],
    *,
    initial: Float[ArrayLike, "*rest"] | None = None,
) -> Float[Array, " time_out *rest"]:
    """New events per day as daily differences of a cumulative quantity.

    `cumulative[t]` is the cumulative count on day `t` (for instance `D`, or
    `1 - S` for infections in a model of proportions). Without `initial` the
    result has one day fewer: entry `k` holds the events between days `k` and
    `k + 1`, as the reference problem's loss does. With `initial` (the
    cumulative count before the first day) it keeps the length.

    Examples:
        >>> import jax.numpy as jnp
        >>> incidence(jnp.array([0.0, 1.0, 4.0])).tolist()
        [1.0, 3.0]
        >>> incidence(jnp.array([1.0, 4.0]), initial=0.0).tolist()
        [1.0, 3.0]
    """
    cumulative = jnp.asarray(cumulative)
    if cumulative.ndim == 0:
        raise ValueError("incidence needs a leading time axis; got a scalar.")
    if initial is not None:
        initial = jnp.broadcast_to(jnp.asarray(initial), cumulative.shape[1:])
        cumulative = jnp.concatenate(
            [initial[None].astype(cumulative.dtype), cumulative]
        )
    return jnp.diff(cumulative, axis=0)


@jax.jit
def prevalence(
    *compartments: Float[ArrayLike, " time *rest"],
) -> Float[Array, " time *rest"]:
    """The number in a compartment, or in several together, on each day.

    Sums the given trajectories (of one shape), e.g. `prevalence(I)` or
    `prevalence(I_mild, I_severe)`. Reduce the stages of a box-car chain first.
    """
    if not compartments:
        raise ValueError("prevalence needs at least one compartment.")
    arrays = [jnp.asarray(c) for c in compartments]
    shapes = {a.shape for a in arrays}
    if len(shapes) > 1:
        raise ValueError(f"prevalence needs trajectories of one shape; got {shapes}.")
    total = arrays[0]
    for a in arrays[1:]:
        total = total + a
    return total


@jax.jit
def ascertain(
    events: Float[ArrayLike, " time *rest"],
    fraction: Float[ArrayLike, "..."],
) -> Float[Array, " time *rest"]:
    """Scale events by an ascertainment (reporting) fraction.

    `fraction` is a scalar (constant), or an array aligned with the leading
    axes of `events` and broadcast over the rest: `(time,)` is a time-varying
    fraction shared by all patches, `(time, patch)` one per day and patch, and
    `(1, patch)` a constant one per patch.

    Examples:
        >>> import jax.numpy as jnp
        >>> ascertain(jnp.ones((2, 3)), jnp.array([0.5, 0.25]))[:, 0].tolist()
        [0.5, 0.25]
    """
    events = jnp.asarray(events)
    fraction = jnp.asarray(fraction)
    return events * _align_leading(fraction, events, "fraction")


@jax.jit
def normalize_week_effect(effects: Float[ArrayLike, "7"]) -> Float[Array, "7"]:
    """Seven positive day-of-week multipliers rescaled to mean 1."""
    effects = jnp.asarray(effects)
    if effects.shape != (7,):
        raise ValueError(
            f"A week effect has 7 multipliers (Monday..Sunday); got shape "
            f"{effects.shape}."
        )
    return effects / jnp.mean(effects)


@jax.jit
def week_effect(
    events: Float[ArrayLike, " time *rest"],
    effects: Float[ArrayLike, "7"],
    weekday: Int[ArrayLike, " time"],
) -> Float[Array, " time *rest"]:
    """Multiply each day's events by its day-of-week reporting effect.

    `effects` are 7 positive multipliers for Monday..Sunday, normalised to mean
    1 here (so the weekly total is unchanged on average and only the pattern
    within a week is free). `weekday[t]` is the day of the week of day `t`
    (Monday = 0), e.g. from [`weekday`][epifit.data.weekday].

    Examples:
        >>> import jax.numpy as jnp
        >>> effects = jnp.array([2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])  # Monday heavy
        >>> x = week_effect(jnp.ones(2), effects, jnp.array([0, 1]))
        >>> [round(v, 4) for v in x.tolist()]
        [1.75, 0.875]
    """
    events = jnp.asarray(events)
    weekday = jnp.asarray(weekday)
    if weekday.shape != events.shape[:1]:
        raise ValueError(
            f"weekday needs one entry per day ({events.shape[:1]}); got shape "
            f"{weekday.shape}."
        )
    multiplier = normalize_week_effect(effects)[weekday]
    return events * _align_leading(multiplier, events, "week effect")


@jax.jit
def expected_reports(
    infections: Float[ArrayLike, " time *rest"],
    *,
    delay: AbstractDelay | Float[ArrayLike, " delay"] | None = None,
    ascertainment: Float[ArrayLike, "..."] = 1.0,
    effects: Float[ArrayLike, "7"] | None = None,
    weekday: Int[ArrayLike, " time"] | None = None,
) -> Float[Array, " time *rest"]:
    """Expected reported counts: delay, then ascertainment, then week effect.

    Args:
        infections: new events per day (incidence), leading axis `time`.
        delay: a delay distribution or pmf (see
            [`convolve_delay`][epifit.data.convolve_delay]); `None` for none.
        ascertainment: the reporting fraction (see
            [`ascertain`][epifit.data.ascertain]).
        effects: day-of-week multipliers, or `None` for no week effect.
        weekday: day of the week of each day; required with `effects`.
    """
    reports = jnp.asarray(infections)
    if delay is not None:
        reports = convolve_delay(reports, delay)
    reports = ascertain(reports, ascertainment)
    if effects is not None:
        if weekday is None:
            raise ValueError("A week effect needs weekday (Monday = 0) for each day.")
        reports = week_effect(reports, effects, weekday)
    return reports


def _align_leading(factor: Array, events: Array, what: str) -> Array:
    """Append unit axes so `factor` lines up with the leading axes of `events`."""
    if factor.ndim > events.ndim:
        raise ValueError(
            f"The {what} has shape {factor.shape}, more axes than the events "
            f"{events.shape}."
        )
    for f, e in zip(factor.shape, events.shape, strict=False):
        if f not in (1, e):
            raise ValueError(
                f"The {what} has shape {factor.shape}, which does not line up with "
                f"the leading axes of the events {events.shape}."
            )
    return factor.reshape(factor.shape + (1,) * (events.ndim - factor.ndim))
