"""Reading a parameter's `per_time` and `smoothing` fields (see
`docs/models.md`, "Time-varying parameters")."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from epifit._errors import describe_type
from epifit._toml import Reader, at
from epifit.model._spec import SmoothingSpec, TimeBasisSpec

__all__ = ["PER_TIME_KINDS", "read_per_time", "read_smoothing"]

PER_TIME_KINDS = ("pieces", "spline", "periodic")
SMOOTHING_KINDS = ("random_walk",)
MIN_KNOTS = 4  # a cubic B-spline needs at least 4 basis functions


def read_per_time(r: Reader, value: Any, loc: str) -> TimeBasisSpec:
    """`per_time = 7` (pieces of 7 days), or a table `{ kind = "pieces", days
    = 7 }`, `{ kind = "spline", knots = 10 }`, `{ kind = "periodic", period
    = 365.25, harmonics = 2 }`."""
    if isinstance(value, bool) or not isinstance(value, int | Mapping):
        raise r.fail(
            loc,
            "expected a number of days (pieces, e.g. per_time = 7) or a table "
            '{ kind = "pieces" | "spline" | "periodic", ... }, got '
            + describe_type(value),
        )
    if not isinstance(value, Mapping):
        if value < 1:
            raise r.fail(
                loc, f"pieces must last at least 1 day (per_time >= 1), got {value}"
            )
        return TimeBasisSpec("pieces", days=value)
    if "kind" not in value:
        raise r.fail(
            at(loc, "kind"),
            'missing required field \'kind\': "pieces", "spline" or "periodic"',
        )
    kind = r.choice(value["kind"], at(loc, "kind"), PER_TIME_KINDS)
    if kind == "pieces":
        t = r.table(value, loc, required=("kind", "days"))
        return TimeBasisSpec(kind, days=r.integer(t["days"], at(loc, "days"), 1))
    if kind == "spline":
        t = r.table(value, loc, required=("kind", "knots"))
        knots = r.integer(t["knots"], at(loc, "knots"), MIN_KNOTS)
        return TimeBasisSpec(kind, knots=knots)
    t = r.table(value, loc, required=("kind", "period"), optional=("harmonics",))
    period = r.number(t["period"], at(loc, "period"))
    if not period > 0:
        raise r.fail(at(loc, "period"), f"must be > 0 days, got {period:g}")
    harmonics = r.integer(t.get("harmonics", 1), at(loc, "harmonics"), 1)
    return TimeBasisSpec(kind, period=period, harmonics=harmonics)


def read_smoothing(r: Reader, value: Any, loc: str, basis: TimeBasisSpec | None):
    """`smoothing = { kind = "random_walk", sd = 0.2, order = 1 }` of a
    parameter varying in pieces or as a spline."""
    t = r.table(value, loc, required=("kind", "sd"), optional=("order",))
    r.choice(t["kind"], at(loc, "kind"), SMOOTHING_KINDS)
    if basis is None:
        raise r.fail(
            loc,
            "smoothing applies to a parameter that varies in time; give per_time "
            "(e.g. per_time = 7) or remove smoothing",
        )
    if basis.kind == "periodic":
        raise r.fail(
            loc,
            "a random walk does not apply to the coefficients of a periodic "
            "parameter (a mean and amplitudes, not a sequence in time); remove "
            "smoothing, or use per_time = N or a spline",
        )
    sd = r.number(t["sd"], at(loc, "sd"))
    if not sd > 0:
        raise r.fail(at(loc, "sd"), f"must be > 0, got {sd:g}")
    order = r.integer(t.get("order", 1), at(loc, "order"), 1)
    if order > 2:
        raise r.fail(at(loc, "order"), f"must be 1 or 2, got {order}")
    return SmoothingSpec("random_walk", sd, order)
