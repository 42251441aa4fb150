"""The figure of a profile likelihood (matplotlib, imported lazily, Agg
canvas): the profile above its minimum against the parameter, the cut line,
the likelihood-ratio interval, and the Laplace approximation's quadratic and
interval for comparison."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from epifit._figure import figure_legend
from epifit._paths import save_figure
from epifit.fitting._profile_result import Profile

__all__ = ["plot_profile"]


def plot_profile(
    profile: Profile | str | os.PathLike, out: str | os.PathLike | None = None
):
    """Draw a profile (a [`Profile`][epifit.fitting.Profile] or a
    `PROFILE.nc`): `profile - minimum` against the parameter, the cut
    `chi2_1(level) / 2` as a line, the likelihood-ratio interval shaded, and
    the Laplace interval and its quadratic `(x - x̂)² / (2 se²)` (on the
    transformed scale) dashed, the legend below the axes. Points where the
    inner minimisation did not converge are marked with crosses.

    Returns:
        The `matplotlib.figure.Figure`; written atomically to `out` when given.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not isinstance(profile, Profile):
        profile = Profile.from_netcdf(Path(profile))
    p = profile
    fig = Figure(figsize=(6.4, 4.8), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(p.grid, p.delta, "o-", color="C0", ms=3, label="profile (others re-fitted)")
    bad = ~p.converged
    if bad.any():
        ax.plot(p.grid[bad], p.delta[bad], "x", color="C3", label="not converged")
    se = float(p.attrs.get("laplace_se_unconstrained", math.nan))
    if math.isfinite(se) and se > 0:
        centre = p.grid_x[np.argmin(np.abs(p.grid - p.estimate))]
        quad = np.square(p.grid_x - centre) / (2.0 * se * se)
        ax.plot(p.grid, quad, "--", color="C1", lw=1, label="Laplace quadratic")
    pct = f"{100 * p.level:g}%"
    ax.axhline(p.cut, color="k", lw=0.8, ls=":", label=f"{pct} cut ({p.cut:.3g})")
    lo = p.lower if math.isfinite(p.lower) else p.grid.min()
    hi = p.upper if math.isfinite(p.upper) else p.grid.max()
    ax.axvspan(lo, hi, color="C0", alpha=0.12, label=f"{pct} profile interval")
    if math.isfinite(p.laplace_lower) and math.isfinite(p.laplace_upper):
        for i, end in enumerate((p.laplace_lower, p.laplace_upper)):
            ax.axvline(
                end,
                color="C1",
                ls="--",
                lw=0.8,
                label=f"{pct} Laplace interval" if i == 0 else None,
            )
    ax.axvline(p.estimate, color="0.4", lw=0.8)
    top = max(3.0 * p.cut, float(np.nanmax(p.delta[np.isfinite(p.delta)])))
    ax.set_ylim(-0.05 * top, 1.05 * top)
    ax.set_xlabel(p.parameter)
    ax.set_ylabel("Δ loss: profile − its minimum")
    sides = [
        s for s, ok in zip(("lower", "upper"), p.identifiable, strict=True) if not ok
    ]
    title = f"profile likelihood of {p.parameter}"
    if sides:
        title += f" (not identifiable: {' and '.join(sides)} side)"
    ax.set_title(title, fontsize=10)
    # below the axes, off the curve (a legend inside sat on the interval)
    handles, labels = ax.get_legend_handles_labels()
    figure_legend(fig, list(zip(handles, labels, strict=True)), fontsize=8)
    if out is not None:
        save_figure(fig, out)
    return fig
