"""What the figures share (fits, forecasts, profiles): dated axes, axis labels
with units, one legend per figure outside the panels, and y limits over
everything a panel draws. matplotlib is imported lazily, inside the helpers.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterable
from typing import Any

import numpy as np

# a legend entry's width, in inches: the marker (about two em) and its text
LEGEND_CHAR_IN = 0.5 / 72  # one character, per point of font size
LEGEND_HANDLE_IN = 0.5
MARGIN = 0.06  # of the data's span, above the top (and below a non-zero bottom)
OUTER_CAP = 2.0  # bands above the rest by more than this many of its spans: cut


def date_axis(ax: Any, t: Any) -> None:
    """Ticks of an x axis over times `t` that do not collide: for dates at
    most six, labelled by `ConciseDateFormatter` (day numbers, the month and
    the year once); day numbers keep matplotlib's own ticks."""
    import matplotlib.dates as mdates

    ax.tick_params(labelsize=7)
    if not np.issubdtype(np.asarray(t).dtype, np.datetime64):
        return

    locator = mdates.AutoDateLocator(minticks=3, maxticks=6)
    ax.xaxis.set_major_locator(locator)
    # the offset (right, under the axis) names the year only: the month of
    # the last tick there reads as the month of all of them
    offsets = ["", "%Y", "%Y", "%Y", "%Y", "%Y"]
    formatter = mdates.ConciseDateFormatter(locator, offset_formats=offsets)
    ax.xaxis.set_major_formatter(formatter)
    ax.tick_params(labelsize=7)
    ax.xaxis.get_offset_text().set_fontsize(7)


def unit_label(name: str, obs: Any = None) -> str:
    """The y label of series `name`: with its unit from the observation spec
    `obs` (`per day` / `per N days` for an incidence or a flow, `number on
    the day` for a prevalence), `R_eff` as is, else the name."""
    if obs is None:
        return name
    if obs.kind == "prevalence":
        return f"{name} (number on the day)"
    period = int(getattr(obs, "period", 1) or 1)
    per = (
        "per day"
        if period == 1
        else ("per week" if period == 7 else f"per {period} days")
    )
    return f"{name} ({per})"


def cover_y(
    ax: Any,
    arrays: Iterable[Any],
    *,
    counts: bool = True,
    lines: Iterable[float] = (),
    outer: Iterable[Any] = (),
) -> None:
    """Set the y limits of `ax` over every finite value of `arrays` (data,
    fitted lines, medians) and the reference `lines` (such as 1 for
    `R_eff`), with a margin; from 0 for `counts` that start near it. The
    `outer` arrays (the bands' edges) are covered too unless they reach
    more than `OUTER_CAP` spans of the rest above its top: then the axis
    stops there and a note in the corner gives the bands' top, so the wild
    draws of a poorly determined fit do not flatten the data to a line."""
    v = _finite([*arrays, list(lines)])
    out = _finite(list(outer))
    if v.size == 0 and out.size == 0:
        return
    top = float(v.max()) if v.size else float(out.max())
    cap = top + OUTER_CAP * (top - min(float(v.min()), 0.0)) if v.size else np.inf
    if out.size and out.max() > cap:
        ax.text(
            0.99,
            0.98,
            f"bands up to {out.max():.3g} (clipped)",
            transform=ax.transAxes,
            ha="right",
            va="top",
            fontsize=6.5,
            color="0.3",
        )
        out = np.append(out[out <= cap], cap)
    v = np.concatenate([v, out])
    lo, hi = float(v.min()), float(v.max())
    pad = MARGIN * (hi - lo) or 0.05 * abs(hi) or 1.0
    bottom = 0.0 if counts and 0.0 <= lo <= 0.5 * hi else lo - pad
    ax.set_ylim(bottom, hi + pad)


def _finite(arrays: list) -> np.ndarray:
    parts = [np.asarray(a, float).ravel() for a in arrays]
    v = np.concatenate(parts) if parts else np.zeros(0)
    return v[np.isfinite(v)]


def figure_legend(
    fig: Any,
    entries: list[tuple[Any, str]],
    *,
    title: str | None = None,
    fontsize: float = 7.5,
) -> Any:
    """One legend for the figure, below the panels (constrained layout keeps
    room for it), of `(handle, label)` entries (a tuple of handles is drawn
    one over the other), in as many columns as fit the figure's width, its
    `title` (what the bands are) wrapped to that width."""
    from matplotlib.legend_handler import HandlerTuple

    width = fig.get_figwidth()
    per_char = LEGEND_CHAR_IN * fontsize
    widest = max((len(label) for _, label in entries), default=10)
    entry = LEGEND_HANDLE_IN + per_char * widest
    ncols = max(1, min(len(entries), int((0.95 * width) // entry)))
    if title:
        chars = max(int(0.95 * width / per_char), 30)
        title = "\n".join(textwrap.wrap(title, chars))
    legend = fig.legend(
        [h for h, _ in entries],
        [label for _, label in entries],
        loc="outside lower center",
        ncols=ncols,
        fontsize=fontsize,
        title=title,
        title_fontsize=fontsize,
        frameon=False,
        handler_map={tuple: HandlerTuple(ndivide=None, pad=0)},
    )
    legend.get_title().set_multialignment("left")
    return legend


def short_bands(text: str) -> str:
    """A band description in a few words: `100 parameter draws and Poisson
    observation noise` -> `100 parameter draws + Poisson noise`, `100
    parameter draws only (not observed: ...)` -> `100 parameter draws
    only`."""
    text = text.split(" (", 1)[0]
    if " and " in text and text.endswith(" observation noise"):
        draws, family = text.split(" and ", 1)
        return f"{draws} + {family.removesuffix(' observation noise')} noise"
    return text
