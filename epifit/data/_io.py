"""Reading and writing datasets as netCDF, atomically."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import xarray as xr

from epifit._paths import atomic_write, describe_os_error
from epifit._stored import note_input
from epifit.data._errors import DataError
from epifit.data._validate import PERIOD

_ENGINE = "netcdf4"


def open_dataset(
    path: str | os.PathLike[str], *, group: str | None = None
) -> xr.Dataset:
    """Read a netCDF file (or one group of it) into memory.

    The file is read completely and closed again, so it can be replaced (for
    instance by [`write_dataset`][epifit.data.write_dataset]) while the returned
    dataset is in use. CF-encoded times (`days since ...`) are decoded to
    `datetime64[ns]`; string coordinates come back as NumPy `str` arrays, as they
    were written, and a variable's integer `period` attribute (days per value,
    see [`data_period`][epifit.data.data_period]) as a Python `int`.

    Cost: the whole file is read into memory (one copy of every variable).

    Args:
        path: the netCDF file.
        group: a netCDF group of the file (default: its root), such as the
            `fit` group of a `POSTERIOR.nc` written by `epifit sample`.

    Returns:
        The dataset, loaded into memory.

    Raises:
        DataError: if the file is missing or is not a readable netCDF file; the
            message names the path (and the group).
    """
    path = Path(path)
    if not path.exists():
        raise DataError(f"No such data file: '{path}'.")
    if path.is_dir():
        raise DataError(f"Data file '{path}' is a directory, not a netCDF file.")
    try:
        note_input(path)
        with xr.open_dataset(path, engine=_ENGINE, group=group) as ds:
            ds = ds.load()
    except (OSError, ValueError, TypeError, KeyError, RuntimeError) as e:
        where = f"'{path}'" if group is None else f"group '{group}' of '{path}'"
        raise DataError(f"Cannot read {where} as netCDF: {e}") from e
    # The on-disk encoding (chunk sizes, fill values, time units) describes the
    # file, not the data; kept, it breaks writing a subset or a modified copy.
    return _periods_to_int(_strings_to_str(ds.drop_encoding()))


def write_dataset(ds: xr.Dataset, path: str | os.PathLike[str]) -> Path:
    """Write a dataset to netCDF-4, atomically.

    The dataset is written to a temporary file in the target's directory, flushed
    to disk (`fsync`) and renamed over `path` (`os.replace`), so readers see
    either the old file or the complete new one, never a partial write, even if
    the process is killed mid-write.

    Coordinates, attributes and dtypes survive a round trip through
    [`open_dataset`][epifit.data.open_dataset], with one normalisation: datetimes
    come back as `datetime64[ns]` whatever their resolution in memory.

    Temporaries left by writers killed mid-write (`.NAME.PID.HEX.tmp` of a
    PID no longer alive) are removed first.

    Cost: one full write of the encoded dataset and one `fsync` of the file and
    of its directory; the temporary file needs the dataset's size on disk beside
    the old file until the rename.

    Args:
        ds: the dataset.
        path: the target file; its directory must exist.

    Returns:
        The path written.

    Raises:
        DataError: if the directory does not exist or the dataset cannot be
            encoded as netCDF (for instance an attribute holding a `dict`), or
            the write fails (the errno's meaning: `no space left on device
            (ENOSPC)`).
    """
    path = Path(path)
    if not isinstance(ds, xr.Dataset):
        raise TypeError(f"write_dataset needs an xarray.Dataset; got {type(ds)}.")
    directory = path.parent
    if not directory.is_dir():
        raise DataError(f"Cannot write '{path}': directory '{directory}' missing.")
    _check_attrs(ds)
    try:
        atomic_write(
            path, lambda tmp: ds.to_netcdf(tmp, engine=_ENGINE, format="NETCDF4")
        )
    except OSError as e:
        raise DataError(
            f"Cannot write '{path}' as netCDF: {describe_os_error(e)}"
        ) from e
    except (ValueError, TypeError, RuntimeError) as e:
        raise DataError(
            f"Cannot write '{path}' as netCDF: {_reason(e, ds, directory)}"
        ) from e
    return path


def _reason(e: Exception, ds: xr.Dataset, directory: Path) -> str:
    """What the netCDF writer said, or that the disk is full: the HDF5
    library reports a full disk as `NetCDF: HDF error`."""
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        return str(e)
    if free < ds.nbytes + (1 << 20):
        return (
            f"no space left on device (ENOSPC): {free / 1e6:.1f} MB free in "
            f"'{directory}', the dataset needs about {ds.nbytes / 1e6:.1f} MB"
        )
    return str(e)


_ATTR_TYPES = (str, int, float, np.number, np.ndarray, list, tuple)


def _check_attrs(ds: xr.Dataset) -> None:
    """Reject attributes netCDF cannot hold, naming the variable and attribute."""
    owners: list[tuple[str, dict]] = [("dataset", ds.attrs)]
    owners += [(f"variable '{name}'", ds[name].attrs) for name in ds.variables]
    for owner, attrs in owners:
        for key, value in attrs.items():
            if isinstance(value, bool) or not isinstance(value, _ATTR_TYPES):
                raise DataError(
                    f"Attribute '{key}' of {owner} is a {type(value).__name__}, "
                    "which netCDF cannot store; use a string, a number or an array "
                    "of numbers."
                )


def _strings_to_str(ds: xr.Dataset) -> xr.Dataset:
    """Variable-length strings read back as `object`; restore NumPy `str`."""
    replacements = {}
    for name, var in ds.variables.items():
        if (
            var.dtype == object
            and var.size
            and all(isinstance(v, str) for v in var.values.ravel())
        ):
            replacements[name] = var.copy(data=var.values.astype(str))
    if not replacements:
        return ds
    coords = {k: v for k, v in replacements.items() if k in ds.coords}
    data = {k: v for k, v in replacements.items() if k not in ds.coords}
    return ds.assign_coords(coords).assign(data)


def _periods_to_int(ds: xr.Dataset) -> xr.Dataset:
    """netCDF integer attributes read back as NumPy scalars; restore the `int`
    of a `period` attribute (other values are left for `data_period` to judge).
    Modifies and returns `ds`, which `open_dataset` owns."""
    for var in ds.variables.values():
        value = var.attrs.get(PERIOD)
        if isinstance(value, np.integer):
            var.attrs[PERIOD] = int(value)
    return ds
