"""Figures of fits and simulations (matplotlib, imported lazily).

Figures are built on `matplotlib.figure.Figure` with the Agg canvas, so nothing
here touches pyplot's global state or needs a display; in a notebook,
`display(fig)` shows one.
"""

from __future__ import annotations

import json
import math
import os
import textwrap
from typing import Any

import numpy as np
import xarray as xr

from epifit._paths import save_figure
from epifit._schema import PATCH, TIME

__all__ = ["plot_fit", "select_patches"]

# the effective reproduction number along the trajectory (a row of panels,
# with a line at 1; not a weight in choosing the largest patches)
REFF = "R_eff"
LEVEL = 0.95  # a fit's predictive band: the central 95% of each point's noise
FAMILY_NAMES = {"poisson": "Poisson", "negative_binomial": "NB", "gaussian": "Gaussian"}


def _derived(ds: xr.Dataset) -> list[str]:
    """The derived series of the file (`[derived]` reading the state or
    covariates; the `derived_series` attribute): a row of panels each, like
    `R_eff`, not a weight in choosing the largest patches."""
    return [s for s in json.loads(ds.attrs.get("derived_series", "[]")) if s in ds]


def _series(ds: xr.Dataset) -> list[tuple[str, str | None, str | None]]:
    """`(title, predicted variable, observed variable)` for every panel row."""
    out = []
    for name in ds.data_vars:
        if name.startswith("predicted_"):
            obs = name[len("predicted_") :]
            observed = f"observed_{obs}" if f"observed_{obs}" in ds else None
            out.append((obs, name, observed))
    for name in ds.data_vars:
        if name.startswith("observed_") and f"predicted_{name[9:]}" not in ds:
            out.append((name[9:], None, name))
    if out:
        if REFF in ds:
            out.append((REFF, REFF, None))
        return out + [(s, s, None) for s in _derived(ds)]
    skip = ("predicted_", "observed_", "residual_")
    return [
        (name, name, None)
        for name in ds.data_vars
        if set(ds[name].dims) == {TIME, PATCH} and not name.startswith(skip)
    ]


def select_patches(
    ds: xr.Dataset, patches: list[str] | None = None, max_patches: int = 12
) -> tuple[list[str], str]:
    """The patches to draw: the given ones (checked), or all of them up to
    `max_patches`, else the `max_patches` with the largest observed (or
    predicted) totals. Returns the labels and a note for the title."""
    available = [str(p) for p in ds[PATCH].values] if PATCH in ds.coords else []
    if patches:
        unknown = [p for p in patches if p not in available]
        if unknown:
            shown = available if len(available) <= 20 else available[:20] + ["..."]
            raise ValueError(
                f"Unknown patch(es) {unknown}; the file has {len(available)} "
                f"patches: {', '.join(shown)}"
            )
        return list(patches), ""
    if len(available) <= max_patches:
        return available, ""
    weights = np.zeros(len(available))
    levels = {REFF, *_derived(ds)}
    for title, pred, obs in _series(ds):
        if title in levels and pred == title:
            continue
        var = ds[obs if obs is not None else pred]
        weights += np.nan_to_num(var.sum(TIME, skipna=True).values)
    order = np.argsort(-weights, kind="stable")[:max_patches]
    chosen = [available[i] for i in sorted(order)]
    return chosen, f"{max_patches} of {len(available)} patches (largest)"


def plot_fit(
    source: xr.Dataset | str | os.PathLike,
    out: str | os.PathLike | None = None,
    *,
    patches: list[str] | None = None,
    max_patches: int = 12,
    columns: int = 4,
) -> Any:
    """Draw a fit (`FIT.nc`) or a simulation against its data.

    One block of panels per observed series, then `R_eff` and each derived
    series (`[derived]` reading the state or covariates) where the file has
    them, one panel per patch (small multiples, or the chosen `patches`): the
    model's prediction as a line and the observations as dots; for a fit,
    a last panel with the loss history. A fit's observed series with a noise
    model (poisson, negative binomial, gaussian) get the predictive band of
    that noise at the fitted mean: the central 95% interval of the family
    (at the fitted dispersion or sd) around each predicted point, without
    the parameters' uncertainty (a forecast's bands add it); the heading and
    the legend say so, and least-squares series and simulations have none.

    Cost: a file is read whole into memory; drawing makes one matplotlib axes
    per series and patch drawn (at most `max_patches` patches unless chosen),
    so a figure of many patches is slow to build and to save.

    Args:
        source: a dataset, or a netCDF file from `epifit calibrate` or
            `epifit simulate`.
        out: write the figure here (PNG, PDF or SVG by suffix) when given.
        patches: labels of the patches to draw (default: all, or the
            `max_patches` largest).
        max_patches: the most patches drawn when none are chosen.
        columns: panels per row.

    Returns:
        The `matplotlib.figure.Figure`.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from epifit.data import open_dataset

    ds = open_dataset(source) if isinstance(source, str | os.PathLike) else source
    series = _series(ds)
    if not series:
        raise ValueError(
            "Nothing to plot: the file has no predicted_/observed_ variables and no "
            f"(time, patch) variables; found {sorted(map(str, ds.data_vars))}"
        )
    chosen, note = select_patches(ds, patches, max_patches)
    bands = predictive_bands(ds)
    if not chosen:
        chosen = [None]
    ncols = max(1, min(columns, len(chosen)))
    rows_per = math.ceil(len(chosen) / ncols)
    has_loss = "loss_history" in ds and ds["loss_history"].size > 0
    nrows = rows_per * len(series) + (1 if has_loss else 0)
    fig = Figure(figsize=(3.2 * ncols + 0.6, 2.4 * nrows + 0.8), layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(nrows, ncols)
    for k, row in enumerate(series):
        _draw_series(
            fig,
            grid,
            ds,
            row,
            chosen,
            first_row=k * rows_per,
            legend=k == 0 or row[0] in bands,
            band=bands.get(row[0]),
        )
    if has_loss:
        _draw_loss(fig.add_subplot(grid[nrows - 1, :]), ds)
    width = max(int(11 * fig.get_figwidth()), 30)  # characters of 10 pt
    head = "\n".join(
        textwrap.fill(line, width) for line in _heading(ds, note, bands).splitlines()
    )
    fig.suptitle(head, fontsize=10)
    if out is not None:
        save_figure(fig, out)
    return fig


def _draw_series(
    fig: Any,
    grid: Any,
    ds: xr.Dataset,
    row: tuple[str, str | None, str | None],
    chosen: list[str | None],
    *,
    first_row: int,
    legend: bool,
    band: tuple[str, xr.DataArray, xr.DataArray] | None = None,
) -> None:
    """One block of panels, one per patch (`None`: no patch dim), from grid row
    `first_row`: the observations as dots, the prediction as a line, and
    `band` `(label, lower, upper)` shaded; with `legend`, a legend in the
    first panel."""
    title, pred, obs = row
    ncols = grid.ncols
    t = ds[TIME].values
    for j, patch in enumerate(chosen):
        r, c = first_row + j // ncols, j % ncols
        ax = fig.add_subplot(grid[r, c])
        sel = {} if patch is None else {PATCH: patch}
        if band is not None:
            label, lo, hi = band
            lo, hi = (lo.sel(sel).values, hi.sel(sel).values) if sel else (lo, hi)
            keep = np.isfinite(lo) & np.isfinite(hi)
            ax.fill_between(
                t[keep], lo[keep], hi[keep], color="C0", alpha=0.2, lw=0, label=label
            )
        if obs is not None:
            y = ds[obs].sel(sel).values if sel else ds[obs].values
            ax.plot(t, y, "o", ms=3, color="0.2", label="observed")
        if pred is not None:
            y = ds[pred].sel(sel).values if sel else ds[pred].values
            keep = np.isfinite(y)  # weekly totals are NaN between their dates
            ax.plot(t[keep], y[keep], "-", color="C0", lw=1.6, label="model")
        if title == REFF:
            ax.axhline(1.0, color="0.5", ls=":", lw=1)
        name = title if patch is None else f"{title} — {patch}"
        ax.set_title(name, fontsize=9)
        ax.tick_params(labelsize=7)
        for label in ax.get_xticklabels():
            label.set_rotation(30)
        if j == 0 and legend:
            ax.legend(fontsize=6.5, frameon=False)


def _draw_loss(ax: Any, ds: xr.Dataset) -> None:
    """The loss per iteration (log scale when it spans a decade), with dotted
    lines where the optimiser's phase changes."""
    loss = np.asarray(ds["loss_history"].values, float)
    it = np.arange(1, loss.size + 1)
    finite = loss[np.isfinite(loss)]
    ax.plot(it, loss, "-", color="C3", lw=1.4)
    if finite.size and finite.min() > 0 and finite.max() > 10 * finite.min():
        ax.set_yscale("log")
    if "phase_history" in ds:
        phase = np.asarray(ds["phase_history"].values)
        for i in np.flatnonzero(np.diff(phase)) + 1:
            ax.axvline(i + 0.5, color="0.6", ls=":", lw=1)
    ax.set_xlabel("iteration", fontsize=8)
    ax.set_ylabel("loss", fontsize=8)
    ax.set_title("loss history", fontsize=9)
    ax.tick_params(labelsize=7)


def predictive_bands(ds: xr.Dataset) -> dict[str, tuple[str, Any, Any]]:
    """Per observed series of a fit (`epifit_kind = "fit"`) with a noise
    model: `(label, lower, upper)`, the central `LEVEL` interval of its
    family at the fitted mean (`predicted_NAME`) and the fitted dispersion
    or sd (`epifit.simulation.noise_quantile`). None for a least-squares
    series, a simulation, or a file without its model text."""
    if ds.attrs.get("epifit_kind") != "fit" or not ds.attrs.get("model_text"):
        return {}
    from epifit.model import loads_model
    from epifit.simulation import noise_of, noise_quantile

    spec = loads_model(str(ds.attrs["model_text"]), path="FIT.nc model_text")
    values = _fitted_values(ds)
    out = {}
    for obs in spec.observations:
        pred = ds.get(f"predicted_{obs.name}")
        if obs.family == "least_squares" or pred is None:
            continue
        try:
            family, kw = noise_of(obs, values, "model")
        except (KeyError, ValueError):  # an sd reading covariates: not in the
            continue  # file's parameter table, so no band for this series
        lo, hi = (
            pred.copy(data=noise_quantile(family, q, pred.values, **kw))
            for q in ((1 - LEVEL) / 2, (1 + LEVEL) / 2)
        )
        label = f"{100 * LEVEL:g}% {FAMILY_NAMES[family]} interval at the fit"
        out[obs.name] = (label, lo, hi)
    return out


def _fitted_values(ds: xr.Dataset) -> dict[str, np.ndarray]:
    """The fitted values by parameter name from the file's table (`estimate`
    per `parameter`), per-patch ones as `(patch,)` arrays."""
    names = [str(v) for v in ds["parameter_name"].values]
    estimates = np.asarray(ds["estimate"].values, float)
    out: dict[str, list[float]] = {}
    for name, v in zip(names, estimates, strict=True):
        out.setdefault(name, []).append(float(v))
    return {k: np.asarray(v[0] if len(v) == 1 else v) for k, v in out.items()}


def _heading(ds: xr.Dataset, note: str, bands: dict | None = None) -> str:
    """`model (fit): loss 1.23; note` from the file's attributes, and what
    the lines, dots and bands are."""
    kind = ds.attrs.get("epifit_kind", "simulation")
    head = f"{ds.attrs.get('model', '')} ({kind})"
    if kind == "fit" and "loss" in ds.attrs:
        head += f": loss {float(ds.attrs['loss']):.6g}"
    if note:
        head += f"; {note}"
    line = "the model at the fitted parameters" if kind == "fit" else "the simulation"
    if bands:
        shaded = (
            f"shaded: the central {100 * LEVEL:g}% interval of each observation's "
            f"noise at the fitted mean ({', '.join(bands)}; without parameter "
            "uncertainty)"
        )
    else:
        shaded = "no uncertainty bands"
    return f"{head}\nlines: {line}; dots: observations; {shaded}"
