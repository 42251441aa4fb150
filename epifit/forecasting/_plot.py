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
# a scenario's line style (and colour `C{i}`): a scenario that matches
# another on some patches still shows beneath it
STYLES = ("-", "--", "-.", ":")


def _style(c: int) -> dict[str, Any]:
    return {"color": f"C{c % 10}", "ls": STYLES[c % len(STYLES)]}


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
    columns: int = 4,
) -> Any:
    """Fan charts of a forecast: a block of small multiples per series (all
    patches together, then each chosen patch), every scenario in its own
    colour in every panel, so scenario differences show at a glance.

    Each panel shades the bands between symmetric quantiles (the outermost
    lightest) per scenario, draws its median (else the point estimate) as a
    line and the observations as points, with a dashed vertical line at the
    forecast start. The x axis shows the forecast window and up to twice
    as many days of data before it; each panel's y axis is fitted to the
    forecast window (earlier data are drawn but do not set the scale). The
    heading says what the bands are (parameter draws, and observation noise
    for an observed series: the `bands` attribute of its variable), each
    panel's title the short form; the legend sits below the panels, off the
    data. A derived series (`[derived]` reading the state or covariates)
    has no sum over patches: its panel for all patches draws the median of
    each patch.

    Args:
        source: a forecast Dataset or a `FORECAST.nc` path
            (`epifit_kind = "forecast"`).
        out: write the figure here (PNG, PDF or SVG by suffix) when given.
        patches: patch labels to draw besides the total (default none).
        series: the series to draw (default the observed series, else all,
            then `R_eff` and the derived series where the forecast has them).
        columns: panels per row of a series' block.

    Returns:
        The `matplotlib.figure.Figure`.

    Raises:
        ValueError: not a forecast, unknown patches or series, or `columns`
            not a positive integer.
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
    if isinstance(columns, bool) or not isinstance(columns, int) or columns < 1:
        raise ValueError(f"columns must be an integer >= 1; got {columns!r}")
    series = _series(ds, series)
    derived = json.loads(ds.attrs.get("derived_series", "[]"))
    labels = [str(p) for p in ds[PATCH].values]
    patches = _patches(labels, patches)
    areas: list[str | None] = [None] + patches if len(labels) > 1 else [labels[0]]
    ncols = min(columns, len(areas))
    per = -(-len(areas) // ncols)  # rows of panels per series
    fig = Figure(
        figsize=(3.6 * ncols + 0.4, 2.5 * per * len(series) + 1.5),
        layout="constrained",
    )
    FigureCanvasAgg(fig)
    axes = fig.subplots(per * len(series), ncols, squeeze=False, sharex=True)
    for k, s in enumerate(series):
        for j in range(per * ncols):
            ax = axes[k * per + j // ncols, j % ncols]
            if j >= len(areas):
                ax.remove()
            elif areas[j] is None and s in derived:
                _each_patch(ax, ds, s)
            else:
                _panel(ax, ds, s, areas[j])
    _window(axes[0, 0], ds)
    _legend(fig, ds)
    head = (
        f"{ds.attrs.get('model', '')} forecast: {ds.attrs.get('days', '')} days "
        f"from {ds.attrs.get('forecast_start', '')}; {_band_note(ds, series)}"
    )
    width = int(11 * fig.get_figwidth())  # characters of 10 pt across the figure
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


def _bands_of(ds: xr.Dataset, s: str) -> str:
    """What the quantiles of series `s` are over: its `bands` attribute, else
    (a forecast written before it) the parameter draws."""
    var = ds[f"{s}_total"] if f"{s}_total" in ds else ds[s]
    text = var.attrs.get("bands") or ds[s].attrs.get("bands")
    if text:
        return str(text)
    samples = int(ds.attrs.get("samples", 0))
    return f"{samples} parameter draws" if samples else "the point estimate"


def _short(text: str) -> str:
    """A panel's tag for a band description: `draws + Poisson noise`,
    `draws only`, `noise only` (the point estimate and its noise)."""
    draws = "point estimate" if text.startswith("the point estimate") else "draws"
    if " and " in text and "observation noise" in text:
        family = text.split(" and ", 1)[1].removesuffix(" observation noise")
        return f"{draws} + {family} noise"
    return f"{draws} only"


def _band_note(ds: xr.Dataset, series: Sequence[str]) -> str:
    """What the bands of a forecast's panels are, for its heading: the
    intervals drawn, and per group of series what they are over."""
    levels = np.asarray(ds[QUANTILE].values, float)
    pairs, mid = _bands(levels)
    widths = [f"{100 * (levels[hi] - levels[lo]):g}%" for lo, hi in pairs]
    line = "median" if mid is not None else "point estimate"
    if not widths:
        return f"no symmetric quantiles, no bands; line: the {line}"
    groups: dict[str, list[str]] = {}
    for s in series:
        groups.setdefault(_bands_of(ds, s), []).append(s)
    cov = ds.attrs.get("covariance", "")
    drawn = f" (covariance {cov})" if cov and int(ds.attrs.get("samples", 0)) else ""
    over = "; ".join(f"{', '.join(names)}: over {t}" for t, names in groups.items())
    return (
        f"bands: central {', '.join(widths[::-1])} intervals{drawn}; {over}; "
        f"line: the {line}"
    )


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


def _scenarios(ds: xr.Dataset) -> list[str]:
    return [str(v) for v in ds[SCENARIO].values]


def _panel(ax, ds: xr.Dataset, s: str, area: str | None) -> None:
    """One fan chart of series `s` in patch `area` (`None`: all patches
    together), every scenario in its colour, the y axis fitted to the
    forecast window."""
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
    window = []
    for c, name in enumerate(_scenarios(ds)):
        qs = np.asarray(q.sel({SCENARIO: name}).values, float)
        for k, (lo, hi) in enumerate(pairs):
            alpha = 0.12 + 0.18 * k / max(len(pairs) - 1, 1)
            ax.fill_between(t, qs[lo], qs[hi], color=f"C{c % 10}", alpha=alpha, lw=0)
        if mid is not None:
            line = qs[mid]
        else:
            line = _estimate(ds, s, area, name)
        ax.plot(t, line, lw=1.4, **_style(c))
        window.append(qs[:, start:] if pairs else line[None, start:])
    if s == REFF:
        ax.axhline(1.0, color="0.5", ls=":", lw=1)
    if start < len(t):
        ax.axvline(t[start], color="0.4", ls="--", lw=1)
        _fit_y(ax, np.concatenate(window, axis=0), reff=s == REFF)
    if obs is not None:
        y = np.asarray(obs.values, float)
        top = ax.get_ylim()[1]
        ax.plot(t, np.where(y <= top, y, np.nan), "o", ms=2.2, color="0.15", zorder=3)
        above = y > top  # data off the forecast's scale: a mark on the top edge
        above[: _first_shown(ds)] = False
        if above.any():
            ax.plot(
                t[above],
                np.full(above.sum(), top),
                "^",
                ms=3,
                color="0.55",
                clip_on=False,
                zorder=3,
            )
    ax.set_title(f"{s} — {where} ({_short(_bands_of(ds, s))})", fontsize=8.5)
    _ticks(ax)


def _estimate(ds: xr.Dataset, s: str, area: str | None, name: str) -> np.ndarray:
    est = ds[f"estimate_{s}"].sel({SCENARIO: name})
    if area is not None:
        est = est.sel({PATCH: area})
    elif s == REFF:
        est = ds[f"estimate_{s}_total"].sel({SCENARIO: name})
    else:
        est = est.sum(PATCH, min_count=1)
    return np.asarray(est.values, float)


def _fit_y(ax, values: np.ndarray, *, reff: bool = False) -> None:
    """The y axis over the forecast window's `values` (with 1 for `R_eff`),
    from 0 when they are counts (all >= 0) not far from it."""
    v = values[np.isfinite(values)]
    if v.size == 0:
        return
    lo, hi = float(v.min()), float(v.max())
    if reff:
        lo, hi = min(lo, 1.0), max(hi, 1.0)
    pad = 0.08 * (hi - lo) or 0.05 * abs(hi) or 1.0
    bottom = 0.0 if not reff and 0.0 <= lo <= 0.5 * hi else lo - pad
    ax.set_ylim(bottom, hi + pad)


def _first_shown(ds: xr.Dataset) -> int:
    """The first day drawn: up to twice the forecast's days of data before
    it (at least four weeks)."""
    n = ds.sizes[TIME]
    start = int(ds.attrs.get("forecast_start_day", n))
    return max(0, start - max(2 * (n - start), 28)) if start < n else 0


def _window(ax, ds: xr.Dataset) -> None:
    """The x axis (shared): from `_first_shown` to the horizon's end."""
    t = ds[TIME].values
    ax.set_xlim(t[_first_shown(ds)], t[-1])


def _legend(fig, ds: xr.Dataset) -> None:
    """One legend for the figure, below the panels: each scenario's colour,
    the intervals' shades, the observations and the forecast start."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    levels = np.asarray(ds[QUANTILE].values, float)
    pairs, mid = _bands(levels)
    line = "median" if mid is not None else "point estimate"
    handles = [
        Line2D([], [], lw=2, label=f"{name} ({line})", **_style(c))
        for c, name in enumerate(_scenarios(ds))
    ]
    for k, (lo, hi) in enumerate(pairs):
        alpha = 0.12 + 0.18 * k / max(len(pairs) - 1, 1)
        width = f"{100 * (levels[hi] - levels[lo]):g}% interval"
        handles.append(Patch(color="0.3", alpha=alpha, lw=0, label=width))
    handles += [
        Line2D([], [], ls="", marker="o", ms=3, color="0.15", label="observed"),
        Line2D(
            [],
            [],
            ls="",
            marker="^",
            ms=3,
            color="0.55",
            label="observed, above the forecast's scale",
        ),
        Line2D([], [], ls="--", color="0.4", lw=1, label="forecast start"),
    ]
    fig.legend(
        handles=handles,
        loc="outside lower center",
        ncols=min(len(handles), 6),
        fontsize=7.5,
        frameon=False,
    )


def _ticks(ax) -> None:
    ax.tick_params(labelsize=7)
    for label in ax.get_xticklabels():
        label.set_rotation(30)


def _each_patch(ax, ds: xr.Dataset, s: str) -> None:
    """Derived series `s`, the median (else the point estimate) of each
    patch as a thin line per scenario in its colour: it has no sum over
    patches."""
    levels = np.asarray(ds[QUANTILE].values, float)
    _, mid = _bands(levels)
    t = ds[TIME].values
    start = int(ds.attrs.get("forecast_start_day", len(t)))
    what = "median" if mid is not None else "estimate"
    window = []
    for c, name in enumerate(_scenarios(ds)):
        if mid is not None:
            ys = ds[s].sel({SCENARIO: name}).isel({QUANTILE: mid})
        else:
            ys = ds[f"estimate_{s}"].sel({SCENARIO: name})
        ys = np.asarray(ys.transpose(TIME, PATCH).values, float)
        ax.plot(t, ys, lw=0.8, alpha=0.6, **_style(c))
        window.append(ys[start:])
    if start < len(t):
        ax.axvline(t[start], color="0.4", ls="--", lw=1)
        _fit_y(ax, np.concatenate(window, axis=0))
    ax.set_title(f"{s} — {what} of {EACH}", fontsize=8.5)
    _ticks(ax)
