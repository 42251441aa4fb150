"""Forecast outputs of a model with `[strata]`: the cells back on their axes.

The ensemble solves a stratified model on its cells (patch x stratum,
patch-major; `epifit/model/_strata.py`), so a series per cell (compartments,
`R_eff`, observations with `strata = "each"`) comes out with one entry per
cell where a summed observation has one per patch. Here, once, when the
Dataset is assembled, the cell axis becomes `(patch, STRATUM)`, as
`epifit simulate` writes it; totals over the cells (`_total`) stay as they
are.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import xarray as xr

from epifit.data import PATCH

__all__ = ["forecast_on_cells", "unstack_cells"]


def forecast_on_cells(problem, data_vars, coords, attrs) -> xr.Dataset:
    """The forecast Dataset of `data_vars`, `coords` and `attrs`; with
    `[strata]` its series per cell on `(patch, STRATUM)` (`unstack_cells`)
    and the stratum labels a coordinate."""
    strata = problem.spec.strata
    if strata is not None:
        coords = {**coords, strata.name: list(strata.labels)}
    return xr.Dataset(unstack_cells(problem, data_vars), coords, attrs)


def unstack_cells(problem, data_vars: dict[str, tuple]) -> dict[str, tuple]:
    """`data_vars` (`(dims, array, attrs)` each) with every variable whose
    last dim `patch` runs over the cells given `(..., patch, STRATUM)`.

    A variable is per cell when its last axis has `n_patches * n_strata`
    entries; with `[strata]` (two strata or more) that is never `n_patches`,
    so the sizes tell the two apart."""
    strata = problem.spec.strata
    if strata is None:
        return data_vars
    P, S = problem.n_patches, strata.size
    out: dict[str, Any] = {}
    for name, (dims, a, *attrs) in data_vars.items():
        a = np.asarray(a)
        if dims and dims[-1] == PATCH and a.shape[-1] == P * S:
            dims, a = (*dims, strata.name), a.reshape(*a.shape[:-1], P, S)
        out[name] = (dims, a, *attrs)
    return out
