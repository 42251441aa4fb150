"""Checks of single variables and coordinates, each raising a precise DataError."""

from __future__ import annotations

import numpy as np
import xarray as xr

from epifit._schema import PATCH, PATCH_TO, TIME
from epifit.data._errors import DataError

_DAY = np.timedelta64(1, "D")


def require_variable(ds: xr.Dataset, name: str) -> xr.DataArray:
    if name not in ds.data_vars:
        found = sorted(str(k) for k in ds.data_vars)
        raise DataError(f"No variable '{name}' in dataset; found {found}")
    return ds[name]


def require_dims(da: xr.DataArray, name: str, dims: tuple[str, ...]) -> xr.DataArray:
    """Same dims as `dims`, in any order; returns `da` transposed to `dims`."""
    if da.dims == dims:
        return da
    if sorted(da.dims) == sorted(dims):
        return da.transpose(*dims)
    missing = [d for d in dims if d not in da.dims]
    extra = [d for d in da.dims if d not in dims]
    detail = "; ".join(
        part
        for part in (
            f"missing {missing}" if missing else "",
            f"unexpected {extra}" if extra else "",
        )
        if part
    )
    raise DataError(
        f"Variable '{name}' has dims {tuple(da.dims)}; expected {tuple(dims)} "
        f"({detail})"
    )


def require_real(da: xr.DataArray, name: str) -> None:
    kind = da.dtype.kind
    if kind not in "iuf":
        raise DataError(
            f"Variable '{name}' has dtype {da.dtype}; expected real numbers "
            "(an integer or float dtype)"
        )


def require_finite(da: xr.DataArray, name: str, role: str) -> None:
    """No NaN (if `role` is a covariate) and no infinities (in any variable)."""
    values = np.asarray(da.values, dtype=np.float64)
    if role == "covariate":
        nan = np.isnan(values)
        if nan.any():
            raise DataError(
                f"Covariate '{name}' has {int(nan.sum())} NaN value(s), first at "
                f"{locate(da, int(np.flatnonzero(nan)[0]))}; covariates must be "
                "complete (fill or interpolate them before fitting)"
            )
    inf = np.isinf(values)
    if inf.any():
        raise DataError(
            f"{role.capitalize()} '{name}' has {int(inf.sum())} infinite value(s), "
            f"first at {locate(da, int(np.flatnonzero(inf)[0]))}"
        )


def require_nonnegative(da: xr.DataArray, name: str, what: str) -> None:
    values = np.asarray(da.values, dtype=np.float64)
    negative = values < 0  # NaN compares False: missing is not negative
    if negative.any():
        first = int(np.flatnonzero(negative)[0])
        raise DataError(
            f"Observation '{name}' has {int(negative.sum())} negative value(s), "
            f"first {float(values.flat[first])!r} at {locate(da, first)}; {what} must "
            "be >= 0 (use NaN for missing)"
        )


# No count or level of an epidemic exceeds this; beyond it, float32 loses
# whole units and squared residuals overflow float64 (1e300 ** 2).
MAX_MAGNITUDE = 1e15


def require_magnitude(da: xr.DataArray, name: str, role: str) -> None:
    """Every value's magnitude at most `MAX_MAGNITUDE` (NaN passes)."""
    values = np.asarray(da.values, dtype=np.float64)
    big = np.abs(values) > MAX_MAGNITUDE  # NaN compares False
    if big.any():
        first = int(np.flatnonzero(big)[0])
        raise DataError(
            f"{role.capitalize()} '{name}' has {int(big.sum())} value(s) beyond "
            f"{MAX_MAGNITUDE:g} in magnitude, first {float(values.flat[first])!r} at "
            f"{locate(da, first)}; no count or level is that large: check the "
            "units, or use NaN for missing"
        )


def require_nonnegative_covariate(da: xr.DataArray, name: str, what: str) -> None:
    """A covariate that is `what` (a coupling matrix, a population) is >= 0."""
    values = np.asarray(da.values, dtype=np.float64)
    negative = values < 0
    if negative.any():
        first = int(np.flatnonzero(negative)[0])
        raise DataError(
            f"Covariate '{name}' is {what} and must be >= 0; found "
            f"{int(negative.sum())} negative value(s), first "
            f"{float(values.flat[first])!r} at {locate(da, first)}"
        )


def require_positive(da: xr.DataArray, name: str) -> None:
    values = np.asarray(da.values, dtype=np.float64)
    bad = ~(values > 0)
    if bad.any():
        first = int(np.flatnonzero(bad)[0])
        raise DataError(
            f"Covariate '{name}' must be > 0; found {float(values.flat[first])!r} at "
            f"{locate(da, first)}"
        )


def check_time(ds: xr.Dataset, user: str) -> int:
    """The `time` coordinate is datetime64 or integer, unique, sorted and
    regular: one constant step of `k >= 1` whole days (daily, weekly, ...).

    Returns:
        The step `k` in days (1 for daily data and for a single time point).
    """
    values = _time_values(ds, user)
    unique, counts = np.unique(values, return_counts=True)
    if (counts > 1).any():
        repeated = [fmt_time(v) for v in unique[counts > 1]]
        raise DataError(
            f"Coordinate '{TIME}' has duplicate values {repeated[:10]}; each day may "
            "appear once"
        )
    step = np.diff(values)
    if values.dtype.kind == "M":
        step = step / _DAY
    step = np.asarray(step, dtype=np.float64)
    if (step < 0).any():
        i = int(np.flatnonzero(step < 0)[0])
        raise DataError(
            f"Coordinate '{TIME}' is not sorted: {fmt_time(values[i])} at index {i} "
            f"comes before {fmt_time(values[i + 1])}; sort with ds.sortby('{TIME}')"
        )
    if step.size == 0:
        return 1
    _check_regular(values, step)
    return int(step[0])


_REGULAR = (
    "the axis must be regular (daily, or every k days such as weekly), with NaN "
    "for missing points"
)


def _check_regular(values: np.ndarray, step: np.ndarray) -> None:
    """Every step of `values` (sorted, unique) is one whole number of days."""
    whole = step == np.round(step)
    if not whole.all():
        i = int(np.flatnonzero(~whole)[0])
        raise DataError(
            f"Coordinate '{TIME}' is not in whole days: a step of {fmt_days(step[i])} "
            f"from {fmt_time(values[i])} to {fmt_time(values[i + 1])} (index {i}); "
            f"{_REGULAR}"
        )
    kinds, counts = np.unique(step, return_counts=True)
    k = kinds[int(np.argmax(counts))]  # the most common step, the smallest if tied
    if kinds.size > 1:
        i = int(np.flatnonzero(step != k)[0])
        raise DataError(
            f"Coordinate '{TIME}' is not regular: a step of {fmt_days(step[i])} from "
            f"{fmt_time(values[i])} to {fmt_time(values[i + 1])} (index {i}) where "
            f"the axis's step is {fmt_days(k)}; {_REGULAR} "
            "(reindex to every day, or to every k days)"
        )


def _time_values(ds: xr.Dataset, user: str) -> np.ndarray:
    """The values of a present, 1-D, non-empty `time` coordinate of dates
    (without NaT) or integer day numbers."""
    if TIME not in ds.coords:
        raise DataError(
            f"Dimension '{TIME}' of variable '{user}' has no coordinate; add one, e.g. "
            f"ds.assign_coords({TIME}=pd.date_range('2020-01-01', periods="
            f"{ds.sizes[TIME]}))"
        )
    values = ds[TIME].values
    if values.ndim != 1:
        raise DataError(f"Coordinate '{TIME}' must be 1-D; got dims {ds[TIME].dims}")
    kind = values.dtype.kind
    if kind not in "Miu":
        raise DataError(
            f"Coordinate '{TIME}' has dtype {values.dtype}; expected dates "
            "(datetime64) or integer day numbers"
        )
    if values.size == 0:
        raise DataError(f"Coordinate '{TIME}' is empty")
    if kind == "M" and np.isnat(values).any():
        first = int(np.flatnonzero(np.isnat(values))[0])
        raise DataError(
            f"Coordinate '{TIME}' has a missing date (NaT) at index {first}"
        )
    return values


PERIOD = "period"


def data_period(ds: xr.Dataset, name: str) -> int | None:
    """The period of data variable `name` in days: what one value counts
    (1 for daily counts, 7 for weekly totals).

    It is the variable's `period` attribute if it has one (as `from_csv`
    records), else the step of the `time` axis. The attribute must be a whole
    number of days >= 1 and, on a time axis of a step `k > 1`, equal `k`; on a
    daily axis it may be larger (weekly totals dated on one day a week, NaN
    between).

    Cost: one pass over the `time` coordinate (`check_time`).

    Args:
        ds: the dataset.
        name: a data variable of `ds`.

    Returns:
        The period in days, or `None` if the variable has no `time` dim.

    Raises:
        DataError: if the variable is missing, the attribute is not a whole
            number >= 1 or disagrees with the axis step, or the time axis is
            not regular (see `check_time`); naming the variable.

    Examples:
        >>> import pandas as pd, xarray as xr
        >>> ds = xr.Dataset(
        ...     {"cases": ("time", [3.0, 5.0, 4.0])},
        ...     coords={"time": pd.date_range("2020-03-01", periods=3, freq="7D")},
        ... )
        >>> data_period(ds, "cases")
        7
    """
    da = require_variable(ds, name)
    period = da.attrs.get(PERIOD)
    if period is not None:
        period = _period_attribute(name, period)
    if TIME not in da.dims:
        return None
    step = check_time(ds, name)
    if period is None:
        return step
    if step > 1 and period != step:
        raise DataError(
            f"Variable '{name}' has attribute {PERIOD}={period} but its '{TIME}' "
            f"axis has a step of {fmt_days(step)}; the two must agree (set {PERIOD}="
            f"{step}, or reindex the axis)"
        )
    return period


def _period_attribute(name: str, value) -> int:
    """The `period` attribute of variable `name` as an int >= 1."""
    if isinstance(value, np.ndarray) and value.size == 1:
        value = value.reshape(()).item()
    whole = isinstance(value, int | np.integer) and not isinstance(value, bool)
    if not whole or value < 1:
        raise DataError(
            f"Variable '{name}' has attribute {PERIOD}={_plain(value)!r}; expected a "
            "whole number of days >= 1 (1 for daily counts, 7 for weekly totals)"
        )
    return int(value)


def check_patch(ds: xr.Dataset, user: str) -> xr.Dataset:
    """Unique string labels on `patch`; `patch_to` equal to `patch` if present."""
    if PATCH not in ds.coords:
        raise DataError(
            f"Dimension '{PATCH}' of variable '{user}' has no coordinate; add labels, "
            f"e.g. ds.assign_coords({PATCH}=['north', 'south', ...])"
        )
    labels = ds[PATCH].values
    if labels.dtype.kind != "U" and not all(isinstance(v, str) for v in labels):
        raise DataError(
            f"Coordinate '{PATCH}' has dtype {labels.dtype}; patch labels must be "
            f"strings (ds.assign_coords({PATCH}=ds.{PATCH}.astype(str)))"
        )
    unique, counts = np.unique(labels.astype(str), return_counts=True)
    if (counts > 1).any():
        raise DataError(
            f"Coordinate '{PATCH}' has duplicate labels {unique[counts > 1].tolist()}"
        )
    if PATCH_TO in ds.dims:
        if ds.sizes[PATCH_TO] != ds.sizes[PATCH]:
            raise DataError(
                f"Dimension '{PATCH_TO}' has size {ds.sizes[PATCH_TO]} but "
                f"'{PATCH}' has {ds.sizes[PATCH]}; a coupling matrix is square"
            )
        if PATCH_TO not in ds.coords:
            ds = ds.assign_coords({PATCH_TO: labels})
        elif not np.array_equal(ds[PATCH_TO].values.astype(str), labels.astype(str)):
            raise DataError(
                f"Coordinate '{PATCH_TO}' must hold the labels of '{PATCH}' in the "
                f"same order; got {ds[PATCH_TO].values.tolist()[:10]} and "
                f"{labels.tolist()[:10]}"
            )
    return ds


def locate(da: xr.DataArray, flat: int) -> str:
    """`time=1978-01-22, patch='a'` for the flat index `flat` of `da`."""
    if not da.dims:
        return "the scalar value"
    index = np.unravel_index(flat, da.shape)
    parts = []
    for dim, i in zip(da.dims, index, strict=True):
        if dim in da.coords:
            value = da[dim].values[i]
            label = fmt_time(value) if dim == TIME else repr(_plain(value))
        else:
            label = str(int(i))
        parts.append(f"{dim}={label}")
    return ", ".join(parts)


def fmt_days(n) -> str:
    """`1 day`, `7 days`, `0.5 days`."""
    return f"{float(n):g} day{'' if n == 1 else 's'}"


def fmt_time(value) -> str:
    if isinstance(value, np.datetime64):
        midnight = value == value.astype("datetime64[D]")
        return str(np.datetime_as_string(value, unit="D" if midnight else "auto"))
    return str(_plain(value))


def _plain(value):
    return value.item() if isinstance(value, np.generic) else value
