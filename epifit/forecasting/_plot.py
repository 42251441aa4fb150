"""Fan charts of a forecast (matplotlib, imported lazily, Agg canvas)."""

from __future__ import annotations

import json
import os
import textwrap
from collections.abc import Sequence
from typing import Any

import numpy as np
import xarray as xr

from epifit._paths import save_figure
from epifit.data import PATCH, QUANTILE, SCENARIO, TIME

__all__ = ["plot_forecast"]

TOTAL = "all patches"
EACH = "each patch"  # a derived series has no total: its medians per patch
REFF = "R_eff"  # drawn with a line at 1; its total is over all patches


def _bands(levels: np.ndarray) -> tuple[list[tuple[int, int]], int | None]:
    """Index pairs of symmetric quantile levels (outermost first), and the
    index of the median (or None)."""
    n = levels.size
    pairs = [
        (i, n - 1 - i)
        for i in range(n // 2)
        if np.isclose(levels[i], 1.0 - levels[n - 1 - i])
    ]
    mid = np.flatnonzero(np.isclose(levels, 0.5))
    return pairs, (int(mid[0]) if mid.size else None)


def plot_forecast(
    source: xr.Dataset | str | os.PathLike,
    out: str | os.PathLike | None = None,
    *,
    patches: Sequence[str] | None = None,
    series: Sequence[str] | None = None,
) -> Any:
    """Fan charts of a forecast: one column per scenario, one row per series
    for all patches together and per chosen patch.

    Each panel shades the bands between symmetric quantiles (the outermost
    lightest), draws the median (else the point estimate) as a line and the
    observations as points, with a dashed vertical line at the forecast start.
    Panels of a row share their y axis, so scenarios compare at a glance.
    The heading says what the bands are. A derived series (`[derived]`
    reading the state or covariates) has no sum over patches: its row for
    all patches draws the median of each patch.

    Args:
        source: a forecast Dataset or a `FORECAST.nc` path
            (`epifit_kind = "forecast"`).
        out: write the figure here (PNG, PDF or SVG by suffix) when given.
        patches: patch labels to draw besides the total (default none).
        series: the series to draw (default the observed series, else all,
            then `R_eff` and the derived series where the forecast has them).

    Returns:
        The `matplotlib.figure.Figure`.

    Raises:
        ValueError: not a forecast, or unknown patches or series.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from epifit.data import open_dataset

    ds = open_dataset(source) if isinstance(source, str | os.PathLike) else source
    if ds.attrs.get("epifit_kind") != "forecast":
        raise ValueError(
            f"Not an epifit forecast (epifit_kind = {ds.attrs.get('epifit_kind')!r}); "
            "write one with `epifit forecast` or epifit.forecasting.forecast."
        )
    series = _series(ds, series)
    derived = json.loads(ds.attrs.get("derived_series", "[]"))
    labels = [str(p) for p in ds[PATCH].values]
    patches = _patches(labels, patches)
    areas: list[str | None] = [None] + patches if len(labels) > 1 else [labels[0]]
    scenarios = [str(s) for s in ds[SCENARIO].values]
    rows = [(s, a) for s in series for a in areas]
    ncols = len(scenarios)
    fig = Figure(
        figsize=(3.4 * ncols + 0.6, 2.5 * len(rows) + 0.9), layout="constrained"
    )
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(rows), ncols, squeeze=False, sharex=True, sharey="row")
    for r, (s, area) in enumerate(rows):
        for c, name in enumerate(scenarios):
            if area is None and s in derived:
                _each_patch(axes[r, c], ds, s, name)
            else:
                _panel(axes[r, c], ds, s, area, name)
            if r == 0 and c == 0:
                axes[r, c].legend(fontsize=6.5, frameon=False, loc="upper left")
    head = (
        f"{ds.attrs.get('model', '')} forecast: {ds.attrs.get('days', '')} days "
        f"from {ds.attrs.get('forecast_start', '')}; {_band_note(ds)}"
    )
    width = int(12 * fig.get_figwidth())  # characters of 10 pt across the figure
    fig.suptitle(textwrap.fill(head, max(width, 30)), fontsize=10)
    if out is not None:
        save_figure(fig, out)
    return fig


def _series(ds: xr.Dataset, series: Sequence[str] | None) -> Sequence[str]:
    """The series to draw: those asked for (checked), else the observed
    series (else all) and `R_eff` where the forecast has it."""
    available = json.loads(ds.attrs.get("series", "[]"))
    observed = json.loads(ds.attrs.get("observations", "[]"))
    if series is None:
        series = [s for s in observed if s in available] or available
        derived = json.loads(ds.attrs.get("derived_series", "[]"))
        extra = [s for s in (REFF, *derived) if s in available and s not in series]
        series = [*series, *extra]
    unknown = [s for s in series if s not in available]
    if unknown:
        raise ValueError(
            f"Unknown series {unknown}; the forecast has {', '.join(available)}"
        )
    return series


def _band_note(ds: xr.Dataset) -> str:
    """What the bands of a forecast's panels are, for its heading."""
    samples = int(ds.attrs.get("samples", 0))
    if samples == 0:
        return "no parameter draws: every band collapses onto the point estimate"
    levels = np.asarray(ds[QUANTILE].values, float)
    pairs, mid = _bands(levels)
    widths = [f"{100 * (levels[hi] - levels[lo]):g}%" for lo, hi in pairs]
    line = "median" if mid is not None else "point estimate"
    bands = (
        f"bands: central {', '.join(widths[::-1])} intervals"
        if widths
        else "no symmetric quantiles, no bands"
    )
    cov = ds.attrs.get("covariance", "")
    drawn = f", covariance {cov}" if cov else ""
    return f"{bands} over {samples} parameter draws{drawn}; line: the {line}"


def _patches(labels: list[str], patches: Sequence[str] | None) -> list[str]:
    """The patches to draw besides the total, checked against `labels`."""
    patches = list(patches or [])
    bad = [p for p in patches if p not in labels]
    if bad:
        shown = labels if len(labels) <= 20 else labels[:20] + ["..."]
        raise ValueError(
            f"Unknown patch(es) {bad}; the forecast has {len(labels)} patches: "
            f"{', '.join(shown)}"
        )
    return patches


def _panel(ax, ds: xr.Dataset, s: str, area: str | None, name: str) -> None:
    """One fan chart: series `s` of scenario `name` in patch `area` (`None`:
    all patches together)."""
    levels = np.asarray(ds[QUANTILE].values, float)
    pairs, mid = _bands(levels)
    t = ds[TIME].values
    start = int(ds.attrs.get("forecast_start_day", len(t)))
    obs = ds.get(f"observed_{s}")
    if area is None:
        q = ds[f"{s}_total"]
        obs = None if obs is None else obs.sum(PATCH, min_count=1)
        where = TOTAL
    else:
        q = ds[s].sel({PATCH: area})
        obs = None if obs is None else obs.sel({PATCH: area})
        where = area
    qs = np.asarray(q.sel({SCENARIO: name}).values, float)
    for k, (lo, hi) in enumerate(pairs):
        ax.fill_between(
            t,
            qs[lo],
            qs[hi],
            color="C0",
            alpha=0.18 + 0.22 * k / max(len(pairs), 1),
            lw=0,
            label=f"{100 * (levels[hi] - levels[lo]):g}% interval",
        )
    if mid is not None:
        ax.plot(t, qs[mid], "-", color="C0", lw=1.5, label="median")
    else:
        est = ds[f"estimate_{s}"].sel({SCENARIO: name})
        if area is not None:
            est = est.sel({PATCH: area})
        elif s == REFF:
            est = ds[f"estimate_{s}_total"].sel({SCENARIO: name})
        else:
            est = est.sum(PATCH, min_count=1)
        ax.plot(t, est.values, "-", color="C0", lw=1.5, label="estimate")
    if obs is not None:
        ax.plot(t, obs.values, "o", ms=2.5, color="0.15", label="observed")
    if s == REFF:
        ax.axhline(1.0, color="0.5", ls=":", lw=1)
    if start < len(t):
        ax.axvline(t[start], color="0.4", ls="--", lw=1, label="forecast start")
    ax.set_title(f"{name}: {s} — {where}", fontsize=9)
    ax.tick_params(labelsize=7)
    for label in ax.get_xticklabels():
        label.set_rotation(30)


def _each_patch(ax, ds: xr.Dataset, s: str, name: str) -> None:
    """Derived series `s` of scenario `name`, the median (else the point
    estimate) of each patch as a thin line: it has no sum over patches."""
    levels = np.asarray(ds[QUANTILE].values, float)
    _, mid = _bands(levels)
    t = ds[TIME].values
    if mid is not None:
        ys = ds[s].sel({SCENARIO: name}).isel({QUANTILE: mid})
        what = "median"
    else:
        ys = ds[f"estimate_{s}"].sel({SCENARIO: name})
        what = "estimate"
    ys = np.asarray(ys.transpose(TIME, PATCH).values, float)
    ax.plot(t, ys, "-", color="C0", lw=0.8, alpha=0.6)
    start = int(ds.attrs.get("forecast_start_day", len(t)))
    if start < len(t):
        ax.axvline(t[start], color="0.4", ls="--", lw=1)
    ax.set_title(f"{name}: {s} — {what} of {EACH}", fontsize=9)
    ax.tick_params(labelsize=7)
    for label in ax.get_xticklabels():
        label.set_rotation(30)
