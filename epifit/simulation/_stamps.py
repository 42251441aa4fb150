"""The time stamps an observation is compared at, and its daily expected
series summed onto them (weekly totals).

The solve runs on a daily grid, `t = 0, 1, ..., n_days - 1` (`t = 0` on the
first date of the data). A daily observation is compared on every day it can
be predicted (a level from day 0, an amount over a day from day 1); an
observation of period `P` (`period = "week"` is 7) at the data's stamps,
each the sum of the `P` daily values ending on the stamp (amounts reported on
days `s - P + 1, ..., s`). A stamp whose period starts before the series does
(the first stamp of a weekly amount: its week lies before the data) is not
compared.

Cost: a gather (daily), or one cumulative sum and a gather (aggregated).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from epifit.data import weekday_of
from epifit.model import ObservationSpec

__all__ = [
    "Stamps",
    "at_stamps",
    "default_stamps",
    "period_sums",
    "stamps_of",
    "weekday_of",
]


@dataclasses.dataclass(frozen=True)
class Stamps:
    """Where one observation is compared.

    Attributes:
        days: the day (index into the daily grid) of each compared stamp,
            increasing, `(stamp,)` int.
        rows: for each compared stamp, its row in the data's time axis.
        period: the days summed into each stamp.
        first_day: the day of the first daily value (0 for a level, 1 for an
            amount over a day).
    """

    days: np.ndarray
    rows: np.ndarray
    period: int
    first_day: int

    @property
    def daily(self) -> bool:
        """Every day from the first one, one day each: no gather needed."""
        return self.period == 1 and np.array_equal(
            self.days, np.arange(self.first_day, self.first_day + self.days.size)
        )


def stamps_of(obs: ObservationSpec, days: np.ndarray) -> Stamps:
    """The compared stamps of `obs` among the data's stamps `days` (the day of
    each row of the data's time axis): those whose whole period lies within
    the predicted days."""
    day0 = obs.first_day
    days = np.asarray(days, dtype=np.int64)
    keep = days - obs.period + 1 >= day0
    return Stamps(days[keep], np.flatnonzero(keep), obs.period, day0)


def default_stamps(obs: ObservationSpec, n_days: int) -> Stamps:
    """Stamps without data: every `period`-th day, the first one whose
    period lies within the predicted days."""
    day0 = obs.first_day
    days = np.arange(day0 + obs.period - 1, n_days, obs.period, dtype=np.int64)
    return Stamps(days, np.arange(days.size), obs.period, day0)


def at_stamps(
    series: Float[Array, "day patch"], stamps: Stamps
) -> Float[Array, "stamp patch"]:
    """The daily expected `series` (row `k` for day `first_day + k`) summed over
    each stamp's period: `(stamp, patch)`."""
    if stamps.daily and series.shape[0] == stamps.days.size:
        return series
    end = stamps.days - stamps.first_day  # the row of each stamp's last day
    if stamps.period == 1:
        return series[end]
    cumulative = _cumulative(series)
    return cumulative[end + 1] - cumulative[end + 1 - stamps.period]


def period_sums(
    series: Float[Array, "day patch"], period: int
) -> Float[Array, "day patch"]:
    """The sum of the `period` daily values ending on each day (a weekly total
    dated on every day, as a forecast reports it); NaN on the first
    `period - 1` rows, whose period starts before the series."""
    if period == 1:
        return series
    cumulative = _cumulative(series)
    sums = cumulative[period:] - cumulative[:-period]
    head = jnp.full((period - 1, *series.shape[1:]), jnp.nan, series.dtype)
    return jnp.concatenate([head, sums], axis=0)[: series.shape[0]]


def _cumulative(series: Array) -> Array:
    """`[0, x0, x0 + x1, ...]` along the first axis: one row more."""
    return jnp.concatenate(
        [jnp.zeros_like(series[:1]), jnp.cumsum(series, axis=0)], axis=0
    )
