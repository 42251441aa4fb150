"""Fan charts of a forecast (matplotlib, imported lazily, Agg canvas)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

from epifit._figure import cover_y, date_axis, figure_legend, short_bands, unit_label
from epifit._paths import file_sha256, save_figure
from epifit.data import PATCH, QUANTILE, SCENARIO, TIME

__all__ = ["plot_forecast"]

TOTAL = "all patches"
EACH = "each patch"  # a derived series has no total: its medians per patch
REFF = "R_eff"  # drawn with a line at 1; its total is over all patches
# a scenario's line style (and colour `C{i}`): a scenario that matches
# another on some patches still shows beneath it
STYLES = ("-", "--", "-.", ":")
WINDOW = "0.965"  # the forecast window's background
SHARED = {"color": "0.35", "ls": "-"}  # the days all scenarios share


def _style(c: int) -> dict[str, Any]:
    return {"color": f"C{c % 10}", "ls": STYLES[c % len(STYLES)]}


def _alpha(k: int, n: int) -> float:
    """The fill of band `k` of `n` (outermost first): the outermost lightest."""
    return 0.14 + 0.2 * k / max(n - 1, 1)


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
    colour and line style in every panel, so scenario differences show at a
    glance.

    Each panel shades the bands between symmetric quantiles per scenario in
    the scenario's colour (the outermost lightest, edged by thin lines of
    its style), draws its median (else the point estimate) as a line and
    the observations as points, and shades the forecast window. The x axis
    shows the forecast window and up to twice as many days of data before
    it; each panel's y axis covers everything drawn in that window (data,
    bands, medians; 1 for `R_eff`, with a line there), so neither the data
    nor the forecast is clipped (bands more than two spans of the rest
    above it are cut, with a note of their top). The one legend sits below
    the panels, off the data; its title says what the bands are (parameter
    draws, and observation noise for an observed series: the `bands`
    attribute of its variable), each panel's title the short form. The days
    on which all scenarios' point estimates agree (the fit window, at
    least) are drawn once, in grey. A derived series (`[derived]` reading
    the state or covariates) has no sum over patches: its panel for all
    patches draws the median of each patch.

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
        figsize=(max(3.6 * ncols + 0.6, 6.0), 2.4 * per * len(series) + 1.6),
        layout="constrained",
    )
    FigureCanvasAgg(fig)
    axes = fig.subplots(per * len(series), ncols, squeeze=False, sharex=True)
    spec = _spec(ds)
    for k, s in enumerate(series):
        for j in range(per * ncols):
            ax = axes[k * per + j // ncols, j % ncols]
            if j >= len(areas):
                ax.remove()
                continue
            if areas[j] is None and s in derived:
                _each_patch(ax, ds, s)
            else:
                _panel(ax, ds, s, areas[j])
            if j % ncols == 0:
                ax.set_ylabel(unit_label(s, _observation(spec, s)), fontsize=8)
            date_axis(ax, ds[TIME].values)
    _window(axes[0, 0], ds)
    _legend(fig, ds, series)
    n = len(_scenarios(ds))
    fig.suptitle(
        f"{ds.attrs.get('model', '')}: {ds.attrs.get('days', '')}-day forecast "
        f"from {ds.attrs.get('forecast_start', '')}, {n} scenario{'s' * (n > 1)}",
        fontsize=10,
    )
    if out is not None:
        save_figure(fig, out)
    return fig


def _spec(ds: xr.Dataset) -> Any:
    """The model spec from the forecast's model file where it is still the
    one forecast (its SHA-256 is `model_sha256`), else None (no units)."""
    path = ds.attrs.get("model_file", "")
    sha = ds.attrs.get("model_sha256", "")
    if not path or not sha or not Path(path).is_file() or file_sha256(path) != sha:
        return None
    from epifit.model import load_model

    try:
        return load_model(path)
    except (OSError, ValueError):
        return None


def _observation(spec: Any, s: str) -> Any:
    if spec is None:
        return None
    return next((o for o in spec.observations if o.name == s), None)


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
    """What the bands of a forecast's panels are, for the legend's title:
    the intervals drawn, and per group of series what they are over."""
    levels = np.asarray(ds[QUANTILE].values, float)
    pairs, mid = _bands(levels)
    widths = [f"{100 * (levels[hi] - levels[lo]):g}%" for lo, hi in pairs]
    line = "median" if mid is not None else "point estimate"
    if not widths:
        return f"No symmetric quantiles, no bands; lines: the {line}."
    groups: dict[str, list[str]] = {}
    for s in series:
        groups.setdefault(short_bands(_bands_of(ds, s)), []).append(s)
    cov = ds.attrs.get("covariance", "")
    drawn = f", covariance {cov}" if cov and int(ds.attrs.get("samples", 0)) else ""
    over = "; ".join(f"{', '.join(names)}: {t}" for t, names in groups.items())
    return (
        f"Lines: the {line} of each scenario; bands: central "
        f"{'/'.join(widths[::-1])} predictive intervals ({over}{drawn})."
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
    together), every scenario in its colour, the y axis over everything
    drawn from the first day shown."""
    levels = np.asarray(ds[QUANTILE].values, float)
    pairs, mid = _bands(levels)
    t = ds[TIME].values
    start = int(ds.attrs.get("forecast_start_day", len(t)))
    first = _first_shown(ds)
    obs = ds.get(f"observed_{s}")
    if area is None:
        q = ds[f"{s}_total"]
        obs = None if obs is None else obs.sum(PATCH, min_count=1)
        where = TOTAL
    else:
        q = ds[s].sel({PATCH: area})
        obs = None if obs is None else obs.sel({PATCH: area})
        where = area
    if start < len(t):
        ax.axvspan(t[start], t[-1], color=WINDOW, lw=0, zorder=0)
        ax.axvline(t[start], color="0.4", ls="--", lw=1)
    names = _scenarios(ds)
    qss = [np.asarray(q.sel({SCENARIO: name}).values, float) for name in names]
    lines = [
        qs[mid] if mid is not None else _estimate(ds, s, area, name)
        for qs, name in zip(qss, names, strict=True)
    ]
    # the days all scenarios share (the fit window, at least): drawn once,
    # in grey, so each scenario's colour starts where it differs
    split = _split(ds, s, area, names) if len(names) > 1 else 0
    shown, outer = [], []
    for c, (qs, line) in enumerate(zip(qss, lines, strict=True)):
        style = _style(c)
        if c == 0 and split > 0:
            _fan(
                ax, t[: split + 1], qs[:, : split + 1], line[: split + 1], pairs, SHARED
            )
        part = slice(max(split - 1, 0) if split else 0, None)
        _fan(ax, t[part], qs[:, part], line[part], pairs, style)
        shown.append(line[first:])
        outer += [qs[[lo, hi], first:] for lo, hi in pairs]
    if s == REFF:
        ax.axhline(1.0, color="0.3", ls=":", lw=1)
    if obs is not None:
        y = np.asarray(obs.values, float)
        ax.plot(t, y, "o", ms=2.4, color="0.1", zorder=3)
        shown.append(y[first:])
    cover_y(ax, shown, lines=[1.0] if s == REFF else [], outer=outer)
    ax.set_title(f"{s} — {where} ({_short(_bands_of(ds, s))})", fontsize=8.5)


def _fan(ax, t, qs: np.ndarray, line: np.ndarray, pairs, style: dict) -> None:
    """Bands between the quantile `pairs` of `qs` (the outermost lightest,
    edged by thin lines of `style`) and `line` over them."""
    for k, (lo, hi) in enumerate(pairs):
        alpha = _alpha(k, len(pairs))
        ax.fill_between(t, qs[lo], qs[hi], color=style["color"], alpha=alpha, lw=0)
        if k == 0:  # the outermost band's edges: where scenarios overlap
            for edge in (qs[lo], qs[hi]):
                ax.plot(t, edge, lw=0.6, alpha=0.8, **style)
    ax.plot(t, line, lw=1.8, **style)


def _split(ds: xr.Dataset, s: str, area: str | None, names: list[str]) -> int:
    """The first day on which some scenario's point estimate of `s` in
    `area` differs from the first scenario's (the number of days they all
    share): the point estimate, not the quantiles, whose noise draws differ
    between scenarios even where their trajectories agree."""
    if f"estimate_{s}" not in ds:
        return 0
    first = _estimate(ds, s, area, names[0])
    same = np.ones(first.size, bool)
    for name in names[1:]:
        other = _estimate(ds, s, area, name)
        same &= np.isclose(other, first, rtol=1e-9, atol=0.0, equal_nan=True)
    return int(np.argmin(same)) if not same.all() else same.size


def _estimate(ds: xr.Dataset, s: str, area: str | None, name: str) -> np.ndarray:
    est = ds[f"estimate_{s}"].sel({SCENARIO: name})
    if area is not None:
        est = est.sel({PATCH: area})
    elif s == REFF:
        est = ds[f"estimate_{s}_total"].sel({SCENARIO: name})
    else:
        est = est.sum(PATCH, min_count=1)
    return np.asarray(est.values, float)


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


def _legend(fig, ds: xr.Dataset, series: Sequence[str]) -> None:
    """One legend for the figure, below the panels: each scenario's line
    over its band in its colour, the intervals' shades, the observations
    and the forecast window; its title says what the bands are."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    levels = np.asarray(ds[QUANTILE].values, float)
    pairs, mid = _bands(levels)
    line = "median" if mid is not None else "point estimate"
    entries: list[tuple[Any, str]] = []
    for c, name in enumerate(_scenarios(ds)):
        style = _style(c)
        mark = Line2D([], [], lw=1.8, **style)
        if pairs:  # the line over the scenario's band, in its colour
            band = Patch(color=style["color"], alpha=_alpha(0, len(pairs)), lw=0)
            mark = (band, mark)
        entries.append((mark, f"{name} ({line})"))
    if len(entries) > 1:
        mark = Line2D([], [], lw=1.8, **SHARED)
        if pairs:
            mark = (
                Patch(color=SHARED["color"], alpha=_alpha(0, len(pairs)), lw=0),
                mark,
            )
        entries.append((mark, "all scenarios, where they agree"))
    for k, (lo, hi) in enumerate(pairs):
        width = f"{100 * (levels[hi] - levels[lo]):g}% interval"
        shade = Patch(color="0.35", alpha=_alpha(k, len(pairs)), lw=0)
        entries.append((shade, width))
    if any(f"observed_{s}" in ds for s in series):
        dot = Line2D([], [], ls="", marker="o", ms=3, color="0.1")
        entries.append((dot, "observed"))
    entries.append((Patch(color=WINDOW, lw=0), "forecast window"))
    figure_legend(fig, entries, title=_band_note(ds, series))


def _each_patch(ax, ds: xr.Dataset, s: str) -> None:
    """Derived series `s`, the median (else the point estimate) of each
    patch as a thin line per scenario in its colour: it has no sum over
    patches."""
    levels = np.asarray(ds[QUANTILE].values, float)
    _, mid = _bands(levels)
    t = ds[TIME].values
    start = int(ds.attrs.get("forecast_start_day", len(t)))
    first = _first_shown(ds)
    what = "median" if mid is not None else "estimate"
    if start < len(t):
        ax.axvspan(t[start], t[-1], color=WINDOW, lw=0, zorder=0)
        ax.axvline(t[start], color="0.4", ls="--", lw=1)
    shown = []
    for c, name in enumerate(_scenarios(ds)):
        if mid is not None:
            ys = ds[s].sel({SCENARIO: name}).isel({QUANTILE: mid})
        else:
            ys = ds[f"estimate_{s}"].sel({SCENARIO: name})
        ys = np.asarray(ys.transpose(TIME, PATCH).values, float)
        ax.plot(t, ys, lw=0.8, alpha=0.6, **_style(c))
        shown.append(ys[first:])
    cover_y(ax, shown)
    ax.set_title(f"{s} — {what} of {EACH}", fontsize=8.5)
