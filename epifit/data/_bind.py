"""Binding a model to data: `validate_dataset` and the validated `BoundData`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np
import xarray as xr

from epifit._schema import PATCH, PATCH_TO, POPULATION, TIME
from epifit.data._errors import DataError
from epifit.data._validate import (
    check_patch,
    check_time,
    data_period,
    require_dims,
    require_finite,
    require_magnitude,
    require_nonnegative,
    require_nonnegative_covariate,
    require_positive,
    require_real,
    require_variable,
)

Dims = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class BoundData:
    """A dataset checked against what a model needs, as NumPy arrays.

    Attributes:
        dataset: the validated dataset: restricted to (and ordered as) the
            model's patches, the requested variables transposed to the requested
            dims.
        times: days since the first day, `float64`, shape `(time,)`: the
            dataset's time stamps (`t = 0` on the first day; `0, 7, 14, ...` on
            a weekly axis). `None` if nothing has a `time` dim.
        patches: patch labels in model order, or `None` without a `patch` dim.
        observed: observations as `float64` with the requested dims; missing
            entries (NaN in the data) are replaced by `0.0`, see `mask`.
        mask: `True` where an observation is present, per observed variable.
        covariates: covariates as `float64` with the requested dims.
        step: the step of the `time` axis in whole days (1 daily, 7 weekly),
            or `None` if nothing has a `time` dim.
    """

    dataset: xr.Dataset
    times: np.ndarray | None
    patches: tuple[str, ...] | None
    observed: dict[str, np.ndarray]
    mask: dict[str, np.ndarray]
    covariates: dict[str, np.ndarray]
    step: int | None = None


def validate_dataset(
    ds: xr.Dataset,
    *,
    observations: Mapping[str, Sequence[str]] | None = None,
    covariates: Mapping[str, Sequence[str]] | None = None,
    patches: Sequence[str] | int | None = None,
    subset_patches: bool = False,
    sizes: Mapping[str, int] | None = None,
) -> BoundData:
    """Check a dataset against the variables a model needs, and bind them.

    For every requested variable the checks are: presence, dims (the same
    names, in any order: variables are transposed to the requested order),
    dataset sizes (`sizes`), a real dtype, and finiteness. Observations may be
    NaN (missing: masked out of the likelihood) but not negative (they are
    counts), infinite, nor beyond 1e15 in magnitude (no count is that large);
    covariates may be neither NaN, infinite nor beyond 1e15, a `population` must
    be positive and a coupling matrix (dim `patch_to`) non-negative. The `time`
    coordinate must be dates or integer days, without duplicates, sorted and
    regular (one step of `k` whole days: daily, weekly, ...; the step is
    `BoundData.step`), and the `period` attribute of a requested variable with
    a `time` dim, if any, must agree with it (see
    [`data_period`][epifit.data.data_period]); the `patch` coordinate must
    hold unique string labels, and `patch_to` the same labels in the same
    order.

    Patches are matched by label. The dataset is reordered to the model's
    order. Patches of the model missing from the data are always an error;
    patches of the data missing from the model are an error unless
    `subset_patches=True`, which keeps only the model's patches.

    Cost: NumPy at call time, nothing traced. Presence, dims and dtypes are
    checked on metadata before any value is read; then each requested variable
    is read in a few passes that are linear in its size (finiteness, sign, the
    `float64` copy that [`BoundData`][epifit.data.BoundData] holds). The
    caller's dataset is copied shallowly and never modified; reordering or
    subsetting patches is one `Dataset.sel`, which copies the variables with a
    patch dim.

    Args:
        ds: the dataset.
        observations: observed variable name -> dims, e.g.
            `{"cases": ("time", "patch")}`.
        covariates: covariate name -> dims, e.g.
            `{"mobility": ("time", "patch", "feature")}`; `()` for a scalar.
        patches: the model's patch labels, or their number, or `None` to take
            the dataset's patches as they are.
        subset_patches: keep only the model's patches instead of raising when the
            dataset has more.
        sizes: required sizes of dims, e.g. `{"feature": 7}`.

    Returns:
        The [`BoundData`][epifit.data.BoundData].

    Raises:
        DataError: naming the variable and the mismatch, and listing what the
            dataset has.

    Examples:
        >>> import numpy as np, pandas as pd, xarray as xr
        >>> ds = xr.Dataset(
        ...     {"in_bed": ("time", [3.0, np.nan, 26.0])},
        ...     coords={"time": pd.date_range("1978-01-22", periods=3)},
        ... )
        >>> bound = validate_dataset(ds, observations={"in_bed": ("time",)})
        >>> bound.times.tolist(), bound.mask["in_bed"].tolist()
        ([0.0, 1.0, 2.0], [True, False, True])
        >>> from epifit.data import DataError
        >>> try:
        ...     validate_dataset(ds, observations={"cases": ("time",)})
        ... except DataError as e:
        ...     print(e)
        No variable 'cases' in dataset; found ['in_bed']
    """
    if not isinstance(ds, xr.Dataset):
        raise TypeError(f"validate_dataset needs an xarray.Dataset; got {type(ds)}.")
    observations, covariates = _requests(observations, covariates)
    requested = {**observations, **covariates}
    ds = ds.copy(deep=False)  # never modify the caller's dataset
    _check_variables(ds, requested, sizes or {})
    uses = {d: n for n, dims in reversed(requested.items()) for d in dims}
    times, step = _bind_time(ds, requested, uses.get(TIME))
    labels = None
    if PATCH in uses or PATCH_TO in uses:
        ds = _bind_patches(ds, uses, patches, subset_patches)
        labels = tuple(str(p) for p in ds[PATCH].values)
    observed, mask = _bind_observations(ds, observations)
    bound_covariates = _bind_covariates(ds, covariates)
    return BoundData(
        dataset=ds,
        times=times,
        patches=labels,
        observed=observed,
        mask=mask,
        covariates=bound_covariates,
        step=step,
    )


def _requests(
    observations: Mapping[str, Sequence[str]] | None,
    covariates: Mapping[str, Sequence[str]] | None,
) -> tuple[dict[str, Dims], dict[str, Dims]]:
    """The requested variables as `name -> dims` tuples; no name in both roles."""
    observations = {k: tuple(d) for k, d in (observations or {}).items()}
    covariates = {k: tuple(d) for k, d in (covariates or {}).items()}
    both = sorted(set(observations) & set(covariates))
    if both:
        raise ValueError(
            f"Variables {both} are requested as observation and covariate."
        )
    return observations, covariates


def _check_variables(
    ds: xr.Dataset, requested: Mapping[str, Dims], sizes: Mapping[str, int]
) -> None:
    """Every requested variable is present, with its dims and a real dtype, and
    the dims in `sizes` have those sizes. Reads no values."""
    arrays = {name: require_variable(ds, name) for name in requested}
    for name, dims in requested.items():
        require_dims(arrays[name], name, dims)
        require_real(arrays[name], name)
    for dim, size in sizes.items():
        users = [n for n, dims in requested.items() if dim in dims]
        if dim not in ds.dims:
            raise DataError(
                f"No dimension '{dim}' in dataset; found {sorted(map(str, ds.dims))}"
            )
        if ds.sizes[dim] != size:
            raise DataError(
                f"Dimension '{dim}' has size {ds.sizes[dim]} in the dataset; "
                f"expected {size} (used by {users})"
            )


def _bind_time(
    ds: xr.Dataset, requested: Mapping[str, Dims], user: str | None
) -> tuple[np.ndarray | None, int | None]:
    """`(times, step)`: the days since the first of a regular `time` axis and
    its step, after checking the `period` of each requested time variable;
    `(None, None)` if no requested variable (`user` the first) has a time dim."""
    if user is None:
        return None, None
    step = check_time(ds, user)
    for name, dims in requested.items():
        if TIME in dims:
            data_period(ds, name)
    return time_index(ds), step


def _bind_patches(
    ds: xr.Dataset,
    uses: Mapping[str, str],
    patches: Sequence[str] | int | None,
    subset: bool,
) -> xr.Dataset:
    """`ds` with checked `patch` (and `patch_to`) labels, matched to the model's
    patches; `uses` maps each dim to the first variable that has it."""
    if PATCH not in ds.dims:
        raise DataError(
            f"Variable '{uses.get(PATCH_TO)}' has dim '{PATCH_TO}' but the "
            f"dataset has no '{PATCH}' dim"
        )
    ds = check_patch(ds, uses.get(PATCH, uses.get(PATCH_TO)))
    return _match_patches(ds, patches, subset)


def _bind_observations(
    ds: xr.Dataset, observations: Mapping[str, Dims]
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The observations as `float64` with NaN replaced by 0, and their masks.

    Writes each variable, transposed to its requested dims, back into `ds` (the
    caller's shallow copy)."""
    observed, mask = {}, {}
    for name, dims in observations.items():
        da = require_dims(ds[name], name, dims)
        require_finite(da, name, "observation")
        require_nonnegative(da, name, "counts")
        require_magnitude(da, name, "observation")
        values = np.asarray(da.values, dtype=np.float64)
        mask[name] = ~np.isnan(values)
        observed[name] = np.where(mask[name], values, 0.0)
        ds[name] = da
    return observed, mask


def _bind_covariates(
    ds: xr.Dataset, covariates: Mapping[str, Dims]
) -> dict[str, np.ndarray]:
    """The covariates as C-contiguous `float64`; complete, finite, a positive
    `population` and non-negative coupling matrices (dim `patch_to`). Writes
    each variable, transposed to its requested dims, back into `ds` (the
    caller's shallow copy)."""
    bound = {}
    for name, dims in covariates.items():
        da = require_dims(ds[name], name, dims)
        require_finite(da, name, "covariate")
        require_magnitude(da, name, "covariate")
        if name == POPULATION:
            require_positive(da, name)
        if PATCH_TO in dims:
            require_nonnegative_covariate(da, name, "a coupling matrix")
        bound[name] = np.ascontiguousarray(da.values, dtype=np.float64)
        ds[name] = da
    return bound


def _match_patches(
    ds: xr.Dataset, patches: Sequence[str] | int | None, subset: bool
) -> xr.Dataset:
    have = [str(p) for p in ds[PATCH].values]
    if patches is None:
        return ds
    if isinstance(patches, int | np.integer):
        if len(have) != patches:
            raise DataError(
                f"The model has {patches} patches but the dataset has {len(have)}: "
                f"{_preview(have)}"
            )
        return ds
    if isinstance(patches, str):
        raise TypeError("patches must be a sequence of labels, not one string.")
    want = [str(p) for p in patches]
    repeated = sorted({p for p in want if want.count(p) > 1})
    if repeated:
        raise ValueError(f"The model's patches {repeated} are listed more than once.")
    missing = [p for p in want if p not in set(have)]
    if missing:
        raise DataError(
            f"Patches in the model but not in the dataset: {_preview(missing)}; "
            f"the dataset has {_preview(have)}"
        )
    extra = [p for p in have if p not in set(want)]
    if extra and not subset:
        raise DataError(
            f"Patches in the dataset but not in the model: {_preview(extra)}; pass "
            "subset_patches=True to keep only the model's patches "
            f"{_preview(want)}"
        )
    if want == have:
        return ds
    selection = {PATCH: want}
    if PATCH_TO in ds.dims:
        selection[PATCH_TO] = want
    return ds.sel(selection)


def _preview(labels: list[str], n: int = 10) -> str:
    if len(labels) <= n:
        return str(labels)
    return f"{labels[:n]} ... ({len(labels)} in all)"


def time_index(ds: xr.Dataset | xr.DataArray) -> np.ndarray:
    """Days since the first day of the `time` coordinate, as `float64`.

    This is the solver's time axis: `t = 0` on the first day, `t = k` on the
    `k`-th day after it.

    Args:
        ds: a dataset or data array with a `time` coordinate of dates or integer
            days.

    Returns:
        An array of shape `(time,)`.

    Raises:
        DataError: without a `time` coordinate or with one of another dtype.

    Examples:
        >>> import pandas as pd, xarray as xr
        >>> ds = xr.Dataset(coords={"time": pd.date_range("2020-02-28", periods=3)})
        >>> time_index(ds).tolist()
        [0.0, 1.0, 2.0]
    """
    if TIME not in ds.coords:
        found = sorted(str(c) for c in ds.coords)
        raise DataError(f"No coordinate '{TIME}'; found {found}")
    values = ds[TIME].values
    if values.size == 0:
        raise DataError(f"Coordinate '{TIME}' is empty")
    if values.dtype.kind == "M":
        return np.asarray((values - values[0]) / np.timedelta64(1, "D"), np.float64)
    if values.dtype.kind in "iu":
        return (values - values[0]).astype(np.float64)
    raise DataError(
        f"Coordinate '{TIME}' has dtype {values.dtype}; expected dates (datetime64) "
        "or integer day numbers"
    )


def weekday(ds: xr.Dataset | xr.DataArray) -> np.ndarray:
    """Day of the week of each day of `time` (Monday = 0, ..., Sunday = 6).

    For [`week_effect`][epifit.data.week_effect]. Integer day numbers carry no
    calendar, so a dated `time` coordinate is required.

    Examples:
        >>> import pandas as pd, xarray as xr
        >>> ds = xr.Dataset(coords={"time": pd.date_range("1978-01-22", periods=2)})
        >>> weekday(ds).tolist()  # 22 January 1978 was a Sunday
        [6, 0]
    """
    if TIME not in ds.coords:
        found = sorted(str(c) for c in ds.coords)
        raise DataError(f"No coordinate '{TIME}'; found {found}")
    values = ds[TIME].values
    if values.dtype.kind != "M":
        raise DataError(
            f"Coordinate '{TIME}' has dtype {values.dtype}; the day of the week needs "
            "dates (datetime64), not day numbers"
        )
    return weekday_of(values)


def weekday_of(dates: np.ndarray) -> np.ndarray:
    """The day of the week of each date, Monday 0 (1970-01-01 was a Thursday)."""
    days = np.asarray(dates).astype("datetime64[D]").astype(np.int64)
    return ((days + 3) % 7).astype(np.int32)
