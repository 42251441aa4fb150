"""Reading tables of counts (CSV) into epifit's dataset conventions."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import xarray as xr

from epifit._schema import PATCH, TIME
from epifit.data._errors import DataError
from epifit.data._validate import PERIOD, fmt_days, fmt_time


def from_csv(
    path: str | os.PathLike[str],
    *,
    time: str = "date",
    patch: str | None = None,
    values: Sequence[str] | None = None,
    attrs: Mapping[str, object] | None = None,
    fill_days: bool = True,
) -> xr.Dataset:
    """Read a CSV table of counts into a dataset with dims `(time[, patch])`.

    Two layouts are understood:

    - **long** (`patch` given): one row per date and place, e.g. columns
      `date, region, cases, deaths`. The table is pivoted to variables with dims
      `(time, patch)`; a (date, place) pair without a row becomes NaN (missing).
    - **wide** (`patch=None`): one row per date and one column per series, for a
      single population, e.g. `date, in_bed, convalescent`; variables have dims
      `(time,)`.

    The time column holds dates (anything `pandas.to_datetime` parses, such as
    `1978-01-22`, at midnight and without a time zone: a time of day, such as
    `2020-03-01T12:00`, is refused rather than dropped) or integer day numbers.
    The period of the series is the most common step `k` between consecutive
    dates (the smallest if tied): 1 for a daily table, 7 for weekly totals.
    Every step must be a multiple of `k` (a missing day or week); one that is
    not (steps of 7 and 3 days) is an error. With `fill_days=True` (the
    default) the time axis is completed to every `k`-th day from the first
    date to the last, with NaN where a date has no row: every day for a daily
    table, every week for a weekly one (never six NaN days a week). Each
    imported variable records `k` as its attribute `period` (an int, in days;
    see [`data_period`][epifit.data.data_period]).
    Place labels are read as strings (so `01001` keeps its leading zero) and
    values as `float64`, so that missing entries can be NaN.

    Cost: pandas reads the whole table into memory; the checks are linear in
    the rows and the pivot sorts the (date[, place]) keys. The result is dense:
    `time x patch` `float64` values per value column, however sparse the rows.

    Args:
        path: the CSV file.
        time: name of the date column.
        patch: name of the place column (long layout), or `None` (wide layout).
        values: the value columns to read; by default all other columns.
        attrs: attributes of the dataset (`source`, `title`, ...). By default
            `source` is the file name.
        fill_days: complete the time axis to every `k`-th day between first
            and last. Without it the dates are kept as they are, and a table
            whose steps are not multiples of one step gets no `period`.

    Returns:
        The dataset, with a `time` coordinate (and `patch` in the long layout),
        its variables with the attribute `period`.

    Raises:
        DataError: if the file is missing or unreadable, a named column is absent
            (the message lists the columns found), a date or value does not
            parse, a date has a time of day or a time zone (naming the row), a
            (date, place) pair appears twice, or (with `fill_days`) a step
            between dates is not a multiple of the table's period (naming the
            dates and the steps).

    Examples:
        >>> import io, pathlib, tempfile
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "cases.csv"
        >>> _ = p.write_text("date,region,cases\\n2020-03-01,north,3\\n"
        ...                  "2020-03-02,north,5\\n2020-03-02,south,1\\n")
        >>> ds = from_csv(p, patch="region", values=["cases"])
        >>> ds["cases"].dims
        ('time', 'patch')
        >>> ds["cases"].sel(patch="south").values.tolist()
        [nan, 1.0]
        >>> ds["cases"].attrs["period"]
        1
    """
    path = Path(path)
    table = _read_table(path, patch)
    values = _value_columns(list(table.columns), path, time, patch, values)
    if len(table) == 0:
        raise DataError(f"'{path}' has a header but no rows.")
    table = _parse_columns(table, path, time, values)
    keys = [time] if patch is None else [time, patch]
    _check_keys(table, path, keys, patch)
    ds = _pivot(table, keys, values, time, patch)
    period = _period(ds[TIME].values, path, strict=fill_days)
    if fill_days:
        ds = ds.reindex({TIME: _regular_range(ds[TIME].values, period)})
    for name in values if period is not None else ():
        ds[name].attrs[PERIOD] = period
    ds.attrs.update({"source": path.name} if attrs is None else dict(attrs))
    return ds


def _value_columns(
    columns: list[str],
    path: Path,
    time: str,
    patch: str | None,
    values: Sequence[str] | None,
) -> list[str]:
    """The value columns: the named ones (checked) or all but time and patch."""
    for role, name in (("time", time), ("patch", patch)):
        if name is not None and name not in columns:
            raise DataError(f"No {role} column '{name}' in '{path}'; found {columns}.")
    if values is None:
        values = [c for c in columns if c not in (time, patch)]
    else:
        values = list(values)
        for name in values:
            if name not in columns:
                raise DataError(f"No column '{name}' in '{path}'; found {columns}.")
        if time in values or (patch is not None and patch in values):
            raise DataError(
                f"Value columns {values} of '{path}' include the time or patch column."
            )
    if not values:
        raise DataError(f"No value columns in '{path}'; found {columns}.")
    return values


def _parse_columns(
    table: pd.DataFrame, path: Path, time: str, values: list[str]
) -> pd.DataFrame:
    """A copy of `table` with the time column parsed and the values as `float64`."""
    times = _parse_time(table[time], time, path)
    table = table.assign(**{time: times})
    for name in values:
        table[name] = _parse_values(table[name], name, path)
    return table


def _check_keys(
    table: pd.DataFrame, path: Path, keys: list[str], patch: str | None
) -> None:
    """No empty place, and each (date[, place]) key on one row only."""
    if patch is not None and table[patch].isna().any():
        row = int(np.flatnonzero(table[patch].isna().to_numpy())[0])
        raise DataError(f"Empty place in column '{patch}' of '{path}' (row {row + 2}).")
    duplicated = table.duplicated(subset=keys, keep=False)
    if duplicated.any():
        rows = (np.flatnonzero(duplicated.to_numpy()) + 2).tolist()  # 1-based, header
        first = table.loc[duplicated, keys].iloc[0].tolist()
        where = dict(zip(keys, map(_label, first), strict=True))
        raise DataError(
            f"Duplicate rows for {where} in "
            f"'{path}' (file lines {rows[:10]}); each {' and '.join(keys)} may "
            "appear once."
        )


def _pivot(
    table: pd.DataFrame,
    keys: list[str],
    values: list[str],
    time: str,
    patch: str | None,
) -> xr.Dataset:
    """The parsed table as a dataset with dims `(time[, patch])`: places sorted
    as strings, dates sorted, NaN where a key has no row."""
    frame = table.set_index(keys)[values].sort_index()
    ds = xr.Dataset.from_dataframe(frame)
    ds = ds.rename({time: TIME} if patch is None else {time: TIME, patch: PATCH})
    if patch is not None:
        labels = sorted(table[patch].unique().tolist())
        ds = ds.reindex({PATCH: labels}).assign_coords(
            {PATCH: np.asarray(labels, dtype=str)}
        )
    for name in values:
        ds[name] = ds[name].astype(np.float64)
    return ds


def _read_table(path: Path, patch: str | None) -> pd.DataFrame:
    if not path.exists():
        raise DataError(f"No such data file: '{path}'.")
    try:
        return pd.read_csv(
            path,
            dtype=None if patch is None else {patch: str},
            skipinitialspace=True,
        )
    except (OSError, ValueError, pd.errors.ParserError) as e:
        raise DataError(f"Cannot read '{path}' as CSV: {e}") from e


def _parse_time(column: pd.Series, name: str, path: Path) -> np.ndarray:
    if column.isna().any():
        row = int(np.flatnonzero(column.isna().to_numpy())[0])
        raise DataError(f"Empty date in column '{name}' of '{path}' (row {row + 2}).")
    if pd.api.types.is_integer_dtype(column):
        return column.to_numpy(dtype=np.int64)
    try:
        parsed = pd.to_datetime(column.astype(str), format="ISO8601")
    except (ValueError, TypeError):
        parsed = None
    if parsed is None:
        for row, text in enumerate(column.astype(str)):
            try:
                pd.to_datetime(text, format="ISO8601")
            except (ValueError, TypeError):
                raise DataError(
                    f"Cannot read {text!r} in column '{name}' of '{path}' (row "
                    f"{row + 2}) as a date; write dates as YYYY-MM-DD or use "
                    "integer day numbers."
                ) from None
    if getattr(parsed.dt, "tz", None) is not None:
        raise DataError(
            f"Column '{name}' of '{path}' has dates with a time zone (row 2: "
            f"{column.iloc[0]!r}); write dates as YYYY-MM-DD."
        )
    off = (parsed != parsed.dt.normalize()).to_numpy()
    if off.any():
        row = int(np.flatnonzero(off)[0])
        raise DataError(
            f"Date {column.iloc[row]!r} in column '{name}' of '{path}' (row "
            f"{row + 2}) has a time of day; epifit counts whole days: write the "
            "date alone (YYYY-MM-DD), or sum the rows of each day before import."
        )
    return parsed.to_numpy().astype("datetime64[ns]")


def _parse_values(column: pd.Series, name: str, path: Path) -> pd.Series:
    numbers = pd.to_numeric(column, errors="coerce")
    bad = numbers.isna() & column.notna()
    if bad.any():
        row = int(np.flatnonzero(bad.to_numpy())[0])
        raise DataError(
            f"Cannot read {column.iloc[row]!r} in column '{name}' of '{path}' (row "
            f"{row + 2}) as a number; leave missing values empty or write NaN."
        )
    return numbers.astype(np.float64)


def _label(value) -> str:
    if isinstance(value, pd.Timestamp) and value == value.normalize():
        return str(value.date())
    return str(value)


def _period(times: np.ndarray, path: Path, strict: bool) -> int | None:
    """The period in days of the sorted, unique `times`: the most common step
    (the smallest if tied; 1 for one date), of which every step is a multiple.

    If a step is not, a DataError naming `path`, the dates and the steps, or
    `None` if not `strict`."""
    steps = _day_steps(times)
    if steps.size == 0:
        return 1
    kinds, counts = np.unique(steps, return_counts=True)
    k = int(kinds[int(np.argmax(counts))])
    off = np.flatnonzero(steps % k)
    if off.size == 0:
        return k
    if not strict:
        return None
    i, j = int(np.flatnonzero(steps == k)[0]), int(off[0])
    raise DataError(
        f"Dates of '{path}' are not regularly spaced: a step of {fmt_days(steps[j])} "
        f"from {fmt_time(times[j])} to {fmt_time(times[j + 1])} is not a "
        f"multiple of the step of {fmt_days(k)} between most "
        f"dates (as from {fmt_time(times[i])} to {fmt_time(times[i + 1])}); steps "
        f"found: {kinds.tolist()} days. Date a weekly series on one day of the "
        "week (every 7 days), and leave missing dates out or their values empty."
    )


def _day_steps(times: np.ndarray) -> np.ndarray:
    """The steps between consecutive `times`, in whole days, as int64."""
    if np.issubdtype(times.dtype, np.datetime64):
        times = times.astype("datetime64[D]").astype(np.int64)
    return np.diff(times.astype(np.int64))


def _regular_range(times: np.ndarray, period: int) -> np.ndarray:
    """Every `period`-th day from the first of `times` to the last."""
    if np.issubdtype(times.dtype, np.datetime64):
        step = np.timedelta64(period, "D")
        return np.arange(times.min(), times.max() + step, step)
    return np.arange(times.min(), times.max() + 1, period, dtype=times.dtype)
