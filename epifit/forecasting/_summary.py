"""Ensemble summaries: quantiles of trajectories, peaks and cumulative totals."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ["LEVELS", "finite_samples", "first_row", "summarize"]

# series summarised by their quantiles only (no peak, no cumulative sum), with
# the `_total` series of the same name in place of a sum over patches
LEVELS = ("R_eff",)


def first_row(name: str, first_rows: Mapping[str, int]) -> int:
    """The first day with a value: 0 for a level, 1 for an amount over a day,
    `first_day + period - 1` for a sum over a period (`first_rows`, by series;
    0 for a series not listed, such as a compartment)."""
    return first_rows.get(name, 0)


def finite_samples(
    series: Mapping[str, np.ndarray],
    first_rows: Mapping[str, int],
    derived: Sequence[str] = (),
) -> np.ndarray:
    """`(sample,)`: whether every series of a sample is finite from its first
    row on; the reproduction number (`LEVELS`, infinite where an infected
    state is never left) and the `derived` series (`I / testing` with no
    tests) do not count: a sample whose solve is finite is valid."""
    finite = np.ones(len(next(iter(series.values()))), bool)
    for s, a in series.items():
        if s in LEVELS or s.removesuffix("_total") in LEVELS or s in derived:
            continue
        body = np.asarray(a)[:, first_row(s, first_rows) :]
        finite &= np.all(np.isfinite(body), axis=tuple(range(1, body.ndim)))
    return finite


def summarize(
    samples: Mapping[str, np.ndarray],
    *,
    quantiles: Sequence[float],
    start: int,
    first_rows: Mapping[str, int],
    derived: Sequence[str] = (),
) -> dict[str, np.ndarray]:
    """Quantiles over the sample axis of every series and of its statistics.

    Args:
        samples: `{series: (sample, time, patch)}`, the valid samples only.
        quantiles: the levels.
        start: the first forecast day (cumulative totals run from it on).
        first_rows: the first day with a value, by series (see `first_row`).
        derived: the derived series (`[derived]` reading the state or
            covariates): quantiles only, like `R_eff`, and no `_total` (a
            ratio or a level of each patch has no sum over patches).

    Returns:
        For each series `s`: `s (quantile, time, patch)`, `s_total (quantile,
        time)` (the sum over patches, per sample), and `peak_day_s`, `peak_s`
        (over the whole horizon), `cumulative_s` (over the forecast days),
        each `(quantile, patch)` with a `_total` twin `(quantile,)`. All NaN
        when there are no samples. A series of `LEVELS` (`R_eff`) has its
        quantiles only, its `_total` those of the sample series
        `R_eff_total (sample, time, 1)`.
    """
    q = np.asarray(quantiles, np.float64)
    out: dict[str, np.ndarray] = {}
    for name, a in samples.items():
        if any(name == f"{v}_total" for v in LEVELS):
            continue
        a = np.asarray(a, np.float64)
        k, T, P = a.shape
        if name in derived:
            out[name] = (
                np.quantile(a, q, axis=0) if k else np.full((q.size, T, P), np.nan)
            )
            continue
        if name in LEVELS:
            total = np.asarray(samples[f"{name}_total"], np.float64)[..., 0]
            out[name] = (
                np.quantile(a, q, axis=0) if k else np.full((q.size, T, P), np.nan)
            )
            out[f"{name}_total"] = (
                np.quantile(total, q, axis=0) if k else np.full((q.size, T), np.nan)
            )
            continue
        first = first_row(name, first_rows)
        if k == 0:
            nan = lambda *shape: np.full((q.size, *shape), np.nan)  # noqa: E731
            out[name], out[f"{name}_total"] = nan(T, P), nan(T)
            for stat in ("peak_day", "peak", "cumulative"):
                out[f"{stat}_{name}"], out[f"{stat}_{name}_total"] = nan(P), nan()
            continue
        total = a.sum(axis=2)
        out[name] = np.quantile(a, q, axis=0)
        out[f"{name}_total"] = np.quantile(total, q, axis=0)
        for suffix, x in (("", a), ("_total", total)):
            body = x[:, first:]
            out[f"peak_day_{name}{suffix}"] = np.quantile(
                first + np.argmax(body, axis=1), q, axis=0
            )
            out[f"peak_{name}{suffix}"] = np.quantile(body.max(axis=1), q, axis=0)
            out[f"cumulative_{name}{suffix}"] = np.quantile(
                x[:, max(start, first) :].sum(axis=1), q, axis=0
            )
    return out
