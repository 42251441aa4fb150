"""The days of a forecast: day numbers, dates and the horizon they lie in."""

from __future__ import annotations

import dataclasses
import datetime as _dt
from typing import Any

import numpy as np

from epifit.forecasting._error import ScenarioError
from epifit.simulation import weekday_of

__all__ = ["Day", "Horizon", "carry_forward", "parse_date"]

Day = int | _dt.date | str | None


def parse_date(text: str, file: str | None, location: str) -> _dt.date:
    try:
        return _dt.date.fromisoformat(text.strip())
    except ValueError:
        raise ScenarioError(
            f"cannot read {text!r} as a date; write YYYY-MM-DD",
            file=file,
            location=location,
        ) from None


@dataclasses.dataclass(frozen=True)
class Horizon:
    """The days of a forecast: `n_fit` days of data, then forecast days up to
    `n_days` in all. Day 0 is the first day of the data (`first_date`, when
    the data have dates)."""

    n_fit: int
    n_days: int
    first_date: np.datetime64 | None = None

    @property
    def dates(self) -> np.ndarray | None:
        if self.first_date is None:
            return None
        return self.first_date + np.arange(self.n_days).astype("timedelta64[D]")

    @property
    def calendar(self) -> dict[str, np.ndarray]:
        """`{"weekday": (n_days,)}` (Monday 0) for week effects, when dated."""
        dates = self.dates
        return {} if dates is None else {"weekday": weekday_of(dates)}

    def label(self, day: int) -> str:
        if self.first_date is None:
            return f"day {day}"
        d = self.first_date + np.timedelta64(int(day), "D")
        return f"{np.datetime_as_string(d, unit='D')} (day {day})"

    def describe(self) -> str:
        return f"{self.label(0)} .. {self.label(self.n_days - 1)}"

    def day(self, v: Any, file: str | None, location: str) -> int:
        """A day number from a day number or a date (or an ISO date string)."""
        if isinstance(v, str):
            v = parse_date(v, file, location)
        if isinstance(v, _dt.date):
            if self.first_date is None:
                raise ScenarioError(
                    f"the data have no dates (time is a day count); give a day "
                    f"number instead of {v.isoformat()}",
                    file=file,
                    location=location,
                )
            delta = np.datetime64(v.isoformat(), "D") - self.first_date
            return int(delta.astype("timedelta64[D]").astype(np.int64))
        return int(v)

    def window(
        self, start: Day, end: Day, file: str | None, loc: str
    ) -> tuple[int, int]:
        """The days `start .. end - 1` of a change at `loc` as day numbers:
        `start` defaults to the first forecast day, `end` to the end of the
        horizon; both must lie in the horizon."""
        T = self.n_days
        first = self.n_fit if start is None else self.day(start, file, f"{loc}.start")
        last = T if end is None else self.day(end, file, f"{loc}.end")
        span = f"the horizon is {self.describe()}"
        if not 0 <= first < T:
            given = "the first forecast day" if start is None else self.label(first)
            raise ScenarioError(
                f"start {given} is outside the horizon; {span}"
                + (" (no forecast days: give days > 0)" if start is None else ""),
                file=file,
                location=f"{loc}.start",
            )
        if not first < last <= T:
            raise ScenarioError(
                f"end {self.label(last)} must lie after the start "
                f"{self.label(first)} and at most one day past the horizon's last "
                f"day; {span}",
                file=file,
                location=f"{loc}.end",
            )
        return first, last


def carry_forward(a: np.ndarray, n_days: int) -> np.ndarray:
    """`a (time, ...)` over `n_days` days: the last day repeated (or cut)."""
    a = np.asarray(a)
    if a.shape[0] >= n_days:
        return a[:n_days]
    tail = np.repeat(a[-1:], n_days - a.shape[0], axis=0)
    return np.concatenate([a, tail], axis=0)
