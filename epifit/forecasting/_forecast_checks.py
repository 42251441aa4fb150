"""Helpers of `epifit.forecasting._forecast` (split from it to keep modules short)."""

from __future__ import annotations

import numpy as np

from epifit._memory import check_memory
from epifit.forecasting._horizon import Horizon
from epifit.forecasting._predictive import (
    NOISE_SAMPLES,
)
from epifit.simulation import Problem


def _check_numbers(days, samples, seed, quantiles) -> np.ndarray:
    """Check the counts; return the quantile levels as an array."""
    for name, v, lo in (("days", days, 0), ("samples", samples, 0), ("seed", seed, 0)):
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < lo:
            raise ValueError(f"{name} must be an integer >= {lo}; got {v!r}.")
    q = np.asarray(quantiles, np.float64).ravel()
    if q.size == 0 or np.any((q < 0) | (q > 1)) or np.any(np.diff(q) <= 0):
        raise ValueError(
            f"quantiles must be increasing levels in [0, 1]; got {list(quantiles)}."
        )
    return q


def _horizon(
    problem: Problem, days: int, samples: int, n_series: int, n_noisy: int
) -> Horizon:
    """The data's days and `days` forecast days after them, checked to fit in
    memory: a scenario's series for every draw (and the `n_noisy` series'
    noisy copies, `NOISE_SAMPLES` or more) and a solve's states, per day."""
    n_fit = int(problem.ts.size)
    first = None if problem.dates is None else np.datetime64(problem.dates[0], "D")
    horizon = Horizon(n_fit=n_fit, n_days=n_fit + int(days), first_date=first)
    if horizon.n_days < 2:
        raise ValueError("A forecast needs at least 2 days in all; give days >= 1.")
    k, p = 1 + int(samples), problem.n_cells
    state = problem.n_states
    noisy = n_noisy * (k + NOISE_SAMPLES)  # at most, by ceil(NOISE_SAMPLES / k)
    rows = f"{k} draws x {n_series} series"
    rows = f"({rows} + {noisy} noisy samples)" if noisy else rows
    check_memory(
        8.0 * horizon.n_days * (2 * (k * n_series + noisy) * p + 3 * state),
        f"days = {days} with {samples} samples",
        f"{horizon.n_days:.3g} days x (2 x {rows} x {p} patches + 3 x {state} "
        "states) x 8 bytes",
        "give fewer days (--days) or samples (--samples)",
    )
    return horizon
