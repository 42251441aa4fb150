"""Pieces of the fit figure (`epifit.plotting.plot_fit`): the loss panel,
the heading, the fitted values by series, and band widths as percentages."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr


def draw_loss(ax: Any, ds: xr.Dataset) -> None:
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


def fitted_values(ds: xr.Dataset) -> dict[str, np.ndarray]:
    """The fitted values by parameter name from the file's table (`estimate`
    per `parameter`), per-patch ones as `(patch,)` arrays."""
    names = [str(v) for v in ds["parameter_name"].values]
    estimates = np.asarray(ds["estimate"].values, float)
    out: dict[str, list[float]] = {}
    for name, v in zip(names, estimates, strict=True):
        out.setdefault(name, []).append(float(v))
    return {k: np.asarray(v[0] if len(v) == 1 else v) for k, v in out.items()}


def heading(ds: xr.Dataset, note: str) -> str:
    """One line: `model: fit to DATA (loss 1.23); note`."""
    kind = ds.attrs.get("epifit_kind", "simulation")
    head = str(ds.attrs.get("model", ""))
    if kind == "fit":
        data = Path(str(ds.attrs.get("data_file", ""))).name
        head += f": fit to {data}" if data else ": fit"
        if "loss" in ds.attrs:
            head += f" (loss {float(ds.attrs['loss']):.6g})"
    else:
        head = f"{head}: {kind}" if head else kind
    return f"{head}; {note}" if note else head


def percent(width: str) -> float:
    return float(width.rstrip("%"))
