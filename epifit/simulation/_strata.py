"""Binding data with a stratum axis (`[strata]`) onto a model's cell axis.

The compiled model of a stratified model has one structure axis, the cells
(patch x stratum, patch-major; `epifit/model/_strata.py`). Here the data's
stratum coordinate is checked against the model's labels and put in their
order, and covariates, initial data and per-stratum observations are
flattened onto the cells, once, at binding (concrete NumPy: a contact matrix
becomes `kron(I_patch, C)`, stored by rows when sparse; the two operands of a
`kron(M, C)` coupling are kept as they are).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import xarray as xr

from epifit.data import PATCH, TIME, DataError
from epifit.model import ModelSpec, cell_array, kron_operands

__all__ = [
    "align_strata",
    "cell_covariates",
    "cell_initial",
    "cell_observed",
    "observed_dims",
]


def align_strata(data: xr.Dataset, spec: ModelSpec, names: Iterable[str], path):
    """`data` with its stratum axes (`age`, `age_to`) in the model's order;
    their labels must be the `[strata]` labels."""
    strata = spec.strata
    if strata is None:
        return data
    used = {n for n in names if n in data.data_vars}
    for dim in (strata.name, strata.to):
        users = sorted(n for n in used if dim in data[n].dims)
        if not users:
            continue
        have = [str(v) for v in data[dim].values] if dim in data.coords else None
        if have is None or sorted(have) != sorted(strata.labels):
            raise DataError(
                f"dim '{dim}' of {users} has labels {have}; the model's [strata] "
                f"{strata.name} has {list(strata.labels)}: give one value per "
                "stratum, labelled as in the model",
                file=path,
            )
        data = data.assign_coords({dim: have}).sel({dim: list(strata.labels)})
    return data


def observed_dims(spec: ModelSpec, data: xr.Dataset) -> dict[str, tuple[str, ...]]:
    """The dims of each observed series the data hold: `(time[, patch])`, and
    the stratum axis of an observation compared per stratum."""
    a = spec.strata.name if spec.strata is not None else None
    out = {}
    for o in spec.observations:
        if o.name in data.data_vars:
            want = (TIME, PATCH) + ((a,) if o.strata == "each" else ())
            out[o.name] = tuple(d for d in want if d in data[o.name].dims)
    return out


def cell_covariates(spec: ModelSpec, values, n_patches: int) -> dict:
    """The bound covariates (of their data dims) on the cell axis; the
    operands of a `kron(M, C)` coupling stay on their own axes."""
    if spec.strata is None:
        return dict(values)
    dims = {c.name: c.data_dims or c.dims for c in spec.covariates}
    kron = kron_operands(spec)
    return {
        k: v if k in kron else cell_array(dims[k], v, n_patches, spec.strata)
        for k, v in values.items()
    }


def cell_initial(spec: ModelSpec, da: xr.DataArray, n_patches: int) -> np.ndarray:
    """An initial-state variable, `([stage,] [patch,] [stratum])`, on the cells:
    `(stage, cell)` or `(cell,)`."""
    a = spec.strata.name
    order = [d for d in da.dims if d not in (PATCH, a)]
    order += [d for d in (PATCH, a) if d in da.dims]
    da = da.transpose(*order)
    return cell_array(tuple(order), da.values, n_patches, spec.strata)


def cell_observed(values: np.ndarray) -> np.ndarray:
    """`(time, [patch,] stratum)` as `(time, cell)`."""
    return values.reshape(values.shape[0], -1)
