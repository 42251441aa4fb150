"""Scenario changes: an abstract change (a dated window and a scale or value)
and its final kinds, each checking itself and binding itself to a model.

A change is built unchecked (from a `SCENARIOS.toml` table, a mapping or
Python) and checked where its place is known: [`check`][] in a scenario,
[`bind`][] against the model, its data and the horizon. Binding gives the
entries it touches; [`apply`][] writes it into one scenario's arrays.
"""

from __future__ import annotations

import abc
import dataclasses
import datetime as _dt
import math
from typing import Any, ClassVar, final

import numpy as np

from epifit._errors import describe_type
from epifit._toml import at, join
from epifit.forecasting._context import BindContext, ScenarioArrays
from epifit.forecasting._error import ScenarioError
from epifit.forecasting._horizon import Day, parse_date

__all__ = [
    "TABLE_FIELDS",
    "AbstractChange",
    "ParameterChange",
    "TransmissionChange",
    "check_name",
]

TABLE_FIELDS = (
    "covariate",
    "parameter",
    "transmission",
    "scale",
    "value",
    "start",
    "end",
    "patches",
    "features",
    "inflow",
    "outflow",
)
"""The fields of a change's TOML table, in the order `to_dict` writes them."""


def _fail(file: str | None, location: str, reason: str) -> ScenarioError:
    return ScenarioError(reason, file=file, location=location)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AbstractChange(abc.ABC):
    """One modification of a scenario: a target (the final class and its
    name) changed by exactly one of `scale` (a factor >= 0) or `value` (a
    replacement) on the days `start .. end - 1`.

    Attributes:
        scale: multiply by this factor (>= 0).
        value: replace by this value.
        start: the first day it applies: a day number (day 0 is the first day
            of the data), a `datetime.date` or an ISO date string; default the
            first forecast day.
        end: the first day it no longer applies (default: the end of the
            horizon).
        patches: patch labels (covariates with a patch axis, per-patch
            parameters, transmission); default all.
    """

    scale: float | None = None
    value: float | None = None
    start: Day = None
    end: Day = None
    patches: tuple[str, ...] | None = None

    table_fields: ClassVar[tuple[str, ...]]
    """The TOML fields this kind of change takes (its target name included)."""
    list_fields: ClassVar[tuple[str, ...]] = ("patches",)
    """Its fields that hold lists of labels, in the order they are checked."""

    def __post_init__(self):
        for name in self.list_fields:
            v = getattr(self, name)
            if isinstance(v, list):
                object.__setattr__(self, name, tuple(v))

    @property
    @abc.abstractmethod
    def target(self) -> str:
        """`covariate 'mobility'`, `parameter 'beta'` or `transmission`."""

    @property
    def field(self) -> str:
        """`"scale"` or `"value"`: how it changes its target."""
        return "scale" if self.scale is not None else "value"

    @property
    def amount(self) -> float:
        """The factor or the replacement."""
        return self.scale if self.scale is not None else self.value

    def to_dict(self) -> dict[str, Any]:
        """The TOML-shaped table (fields left at their default omitted)."""
        given = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out: dict[str, Any] = {}
        for name in TABLE_FIELDS:
            v = given.get(name)
            if v is None:
                continue
            if isinstance(v, _dt.date):
                v = v.isoformat()
            out[name] = list(v) if isinstance(v, tuple) else v
        return out

    def check(self, file: str | None, loc: str) -> None:
        """Check its structure (not yet against a model) at `loc`: its target,
        one finite scale (>= 0) or value, its days and its label lists."""
        self._check_target(file, loc)
        self._check_amount(file, loc)
        for name in ("start", "end"):
            _check_day(getattr(self, name), file, at(loc, name))
        for name in self.list_fields:
            _check_labels(name, getattr(self, name), file, loc)

    @abc.abstractmethod
    def _check_target(self, file: str | None, loc: str) -> None:
        """Check the target's name, for kinds that have one."""

    def _check_amount(self, file: str | None, loc: str) -> None:
        if (self.scale is None) == (self.value is None):
            raise _fail(
                file,
                loc,
                "give exactly one of scale (a factor) or value (a replacement)"
                + ("; got both" if self.scale is not None else ""),
            )
        for name in ("scale", "value"):
            v = getattr(self, name)
            if v is None:
                continue
            if (
                isinstance(v, bool)
                or not isinstance(v, int | float)
                or not math.isfinite(v)
            ):
                raise _fail(
                    file,
                    at(loc, name),
                    f"expected a finite number, got {describe_type(v)}",
                )
        if self.scale is not None and self.scale < 0:
            raise _fail(file, at(loc, "scale"), f"must be >= 0, got {self.scale}")

    @abc.abstractmethod
    def bind(self, ctx: BindContext, loc: str) -> np.ndarray:
        """Check it against the model, data and horizon of `ctx`; return the
        entries it touches, a boolean mask over its target's non-time axes.

        Raises:
            ScenarioError: naming `loc` (and the file) and what is wrong.
        """

    @abc.abstractmethod
    def apply(
        self, start: int, end: int, entries: np.ndarray, arrays: ScenarioArrays
    ) -> None:
        """Write it into `arrays` on the days `start .. end - 1` for
        `entries` (what `bind` returned)."""


def check_name(value: Any, file: str | None, location: str) -> None:
    if not isinstance(value, str) or not value:
        raise _fail(file, location, f"expected a name, got {describe_type(value)}")


def _check_day(v: Any, file: str | None, location: str) -> None:
    if v is None or isinstance(v, _dt.date):
        return
    if isinstance(v, bool) or not isinstance(v, int | str):
        raise _fail(
            file, location, f"expected a day number or a date, got {describe_type(v)}"
        )
    if isinstance(v, int) and v < 0:
        raise _fail(
            file,
            location,
            f"a day number must be >= 0 (day 0 is the first day of the data), got {v}",
        )
    if isinstance(v, str):
        parse_date(v, file, location)


def _check_labels(name: str, v: Any, file: str | None, loc: str) -> None:
    if v is None:
        return
    if not isinstance(v, tuple) or not v:
        raise _fail(
            file, at(loc, name), f"expected a non-empty list, got {describe_type(v)}"
        )
    kinds = (int, str) if name == "features" else (str,)
    for k, item in enumerate(v):
        if isinstance(item, bool) or not isinstance(item, kinds):
            want = "a feature index or label" if name == "features" else "a label"
            raise _fail(
                file,
                f"{loc}.{name}[{k}]",
                f"expected {want}, got {describe_type(item)}",
            )
    dup = sorted({str(x) for x in v if v.count(x) > 1})
    if dup:
        raise _fail(file, at(loc, name), f"listed twice: {join(dup)}")


@final
@dataclasses.dataclass(frozen=True)
class ParameterChange(AbstractChange):
    """Scale or override a model parameter on its constrained scale (chosen
    `patches` of a per-patch one).

    Attributes:
        parameter: a model parameter, e.g. `"beta"`.
    """

    parameter: str

    table_fields: ClassVar[tuple[str, ...]] = (
        "parameter",
        "scale",
        "value",
        "start",
        "end",
        "patches",
    )

    @property
    def target(self) -> str:
        return f"parameter {self.parameter!r}"

    def _check_target(self, file: str | None, loc: str) -> None:
        check_name(self.parameter, file, at(loc, "parameter"))

    def bind(self, ctx: BindContext, loc: str) -> np.ndarray:
        name = self.parameter
        params = {p.name: p for p in ctx.spec.parameters}
        if name not in params:
            raise ctx.fail(
                f"{loc}.parameter",
                f"{self._not_a_parameter(ctx)}; the model's parameters: {join(params)}",
            )
        p = params[name]
        est = np.asarray(ctx.values[name], np.float64)
        if self.patches is not None and not p.per_patch:
            raise ctx.fail(
                f"{loc}.patches",
                f"parameter {name!r} is not per patch; leave out 'patches'",
            )
        mask = np.ones(est.shape, bool)
        if self.patches is not None:  # (patch,), or (patch, stratum) per stratum
            chosen = ctx.select(self.patches, f"{loc}.patches")
            mask &= chosen.reshape(chosen.shape + (1,) * (est.ndim - 1))
        lo, hi = p.bounds
        new = (
            est * self.scale
            if self.scale is not None
            else np.full(est.shape, self.value)
        )
        bad = (new < lo) | (new > hi)
        if np.any(bad & mask):
            v = float(np.ravel(new[bad & mask])[0])
            what = (
                f"scaling {name!r} by {self.scale} gives {v:.6g}"
                if self.scale is not None
                else f"value {v:.6g}"
            )
            raise ctx.fail(
                f"{loc}.{self.field}",
                f"{what}, outside the parameter's range [{lo}, {hi}]",
            )
        return mask

    def _not_a_parameter(self, ctx: BindContext) -> str:
        """Why the name is not one of the model's parameters."""
        name = self.parameter
        if name in {d.name for d in ctx.spec.derived}:
            return (
                f"{name!r} is a derived quantity; change the parameters it is "
                "computed from"
            )
        if name in {n.name for n in ctx.spec.neural}:
            return (
                f"{name!r} is a neural sub-model; to change the rate it gives, "
                "use transmission = true (or change its covariate)"
            )
        return f"unknown parameter {name!r}"

    def apply(
        self, start: int, end: int, entries: np.ndarray, arrays: ScenarioArrays
    ) -> None:
        starts = arrays.interval_starts
        rows = (starts >= start) & (starts < end)
        target = arrays.parameters[self.parameter][self.field]
        target[rows] = np.where(entries, self.amount, target[rows])


@final
@dataclasses.dataclass(frozen=True)
class TransmissionChange(AbstractChange):
    """Scale or override the transmission rate of every infection (also when
    it comes from a neural sub-model), in chosen `patches` (with `[strata]`,
    in every stratum of them)."""

    table_fields: ClassVar[tuple[str, ...]] = (
        "scale",
        "value",
        "start",
        "end",
        "patches",
    )

    @property
    def target(self) -> str:
        return "transmission"

    def to_dict(self) -> dict[str, Any]:
        return {"transmission": True, **super().to_dict()}

    def _check_target(self, file: str | None, loc: str) -> None:
        """Transmission has no name to check."""

    def bind(self, ctx: BindContext, loc: str) -> np.ndarray:
        if not ctx.spec.infections:
            raise ctx.fail(
                f"{loc}.transmission",
                f"model {ctx.spec.name!r} has no infections to change",
            )
        return ctx.cells(ctx.patch_mask(self.patches, loc))

    def apply(
        self, start: int, end: int, entries: np.ndarray, arrays: ScenarioArrays
    ) -> None:
        arrays.transmission[self.field][start:end, entries] = self.amount
