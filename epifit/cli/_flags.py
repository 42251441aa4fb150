"""Validators of the numeric flags, shared by every sub-command (argparse
`type=` functions), so a bad flag fails at parse time with a message naming
it: `--n-starts must be an integer >= 1; got 0`.

The bounds are those of the same settings in a fit file
(`epifit.fitting.parse_fit_config`): counts `>= 1`, the seed `>= 0`,
tolerances and the time budget `> 0` and finite. `epifit calibrate` then
passes its flags through `epifit.fitting.check_fit_settings`, the fit file's
own checks (the limit on starts among them), naming the flags.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def integer(minimum: int, maximum: int | None = None, why: str = "") -> Callable:
    """An integer `>= minimum` (and `<= maximum`, `why` saying why)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be an integer >= {minimum}; got {text!r}"
            ) from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}; got {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be <= {maximum}{why}; got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def number(*, positive: bool = False, nonnegative: bool = False) -> Callable:
    """A finite number (`> 0` with `positive`, `>= 0` with `nonnegative`)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be a number; got {text!r}"
            ) from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number; got {text}")
        if positive and value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0; got {text}")
        if nonnegative and value < 0:
            raise argparse.ArgumentTypeError(f"must be >= 0; got {text}")
        return value

    parse.__name__ = "number"
    return parse


def levels(text: str) -> list[float]:
    """Comma-separated quantile levels in [0, 1]."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be comma-separated numbers; got {text!r}"
        ) from None
    if not values or not all(0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(
            "must be comma-separated levels in [0, 1], e.g. 0.05,0.5,0.95; "
            f"got {text!r}"
        )
    return values


def date(text: str) -> str:
    """A date `YYYY-MM-DD` (kept as text)."""
    import datetime

    try:
        datetime.date.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a date YYYY-MM-DD, e.g. 2020-01-01; got {text!r}"
        ) from None
    return text


count = integer(1)  # iterations, patches, days, repeats, chunk sizes, ...
seed = integer(0)
starts = integer(1)  # its upper bound is the fit's (epifit.fitting.MAX_STARTS)
tolerance = number(positive=True)  # rtol, atol, the time budget
