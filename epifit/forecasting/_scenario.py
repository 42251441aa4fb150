"""Scenarios as data: `SCENARIOS.toml` files and their Python twins.

A scenario is a named list of *changes*, each acting from a `start` day (a
date, or a day number with day 0 the first day of the data) up to but not
including an optional `end` day (default: the end of the horizon):

* **covariates**: scale or replace a time-varying covariate, or part of it:
  chosen `features` and `patches` of `mobility (time, patch, feature)`; the
  `inflow` (rows: what reaches the chosen patches) and/or `outflow` (columns:
  what leaves them) of `coupling (time, patch, patch_to)`;
* **parameters**: scale or override a model parameter on its constrained
  scale (chosen `patches` of a per-patch one);
* **transmission**: scale or override the transmission rate of every
  infection (also when it comes from a neural sub-model), in chosen `patches`.

```toml
days = 60                          # the horizon: days beyond the data (optional)

[scenarios.distancing]
description = "mobility -30 % from the forecast start"
changes = [{ covariate = "mobility", scale = 0.7 }]

[scenarios.lockdown_p03]
changes = [
  { covariate = "coupling", inflow = ["p03"], outflow = ["p03"], scale = 0.0,
    start = 2020-06-01, end = 2020-06-29 },
  { transmission = true, patches = ["p03"], scale = 0.8, start = 2020-06-01 },
]
```

Every scenario is run next to a `baseline` that carries the last observed
covariates forward. A `start` left out is the first forecast day. Changes in
one scenario may not touch the same entries on the same days (whether they
should multiply or the later one win is ambiguous): split them.

Every problem raises [`ScenarioError`][] naming the file (for a file), the
field path and what is wrong, e.g.
`scen.toml: scenarios.lockdown.changes[1].covariate: unknown covariate
'mobilty'; the model's time-varying covariates: coupling, mobility`.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from epifit._errors import LocatedError, describe_type
from epifit._toml import Reader, at, join

__all__ = [
    "BASELINE",
    "Change",
    "Scenario",
    "ScenarioError",
    "ScenarioSet",
    "ScenariosLike",
    "as_scenarios",
    "load_scenarios",
    "parse_scenarios",
]

BASELINE = "baseline"
SCENARIO_FIELDS = ("description", "changes")
TARGETS = ("covariate", "parameter", "transmission")
CHANGE_FIELDS = (
    *TARGETS,
    "scale",
    "value",
    "start",
    "end",
    "patches",
    "features",
    "inflow",
    "outflow",
)

Day = int | _dt.date | str | None


class ScenarioError(LocatedError):
    """An invalid scenario (file, dict or Python object), or one that does not
    fit the model, the data or the horizon.

    `file` is `None` for scenarios built in Python; `location` is a field path
    such as `scenarios.lockdown.changes[0].start`.
    """


@dataclasses.dataclass(frozen=True)
class Change:
    """One modification of a scenario. Give exactly one target (`covariate`,
    `parameter` or `transmission=True`) and exactly one of `scale` (a factor
    >= 0) or `value` (a replacement).

    Attributes:
        covariate: a time-varying covariate of the model, e.g. `"mobility"`.
        parameter: a model parameter, e.g. `"beta"` (constrained scale).
        transmission: change the transmission rate of every infection.
        scale: multiply by this factor (>= 0).
        value: replace by this value.
        start: the first day it applies: a day number (day 0 is the first day
            of the data), a `datetime.date` or an ISO date string; default the
            first forecast day.
        end: the first day it no longer applies (default: the end of the
            horizon).
        patches: patch labels (covariates with a patch axis, per-patch
            parameters, transmission); default all.
        features: feature indices (or labels) of a covariate with a feature
            axis; default all.
        inflow: patch labels whose coupling *rows* change (the pressure of
            infection reaching them from elsewhere).
        outflow: patch labels whose coupling *columns* change (what their
            infectious add elsewhere). With both, the entries in either change.
            A `value` for a coupling replaces the weights of existing links
            (entries non-zero on some day of the data) and creates none.
    """

    covariate: str | None = None
    parameter: str | None = None
    transmission: bool = False
    scale: float | None = None
    value: float | None = None
    start: Day = None
    end: Day = None
    patches: tuple[str, ...] | None = None
    features: tuple[int | str, ...] | None = None
    inflow: tuple[str, ...] | None = None
    outflow: tuple[str, ...] | None = None

    def __post_init__(self):
        for name in ("patches", "features", "inflow", "outflow"):
            v = getattr(self, name)
            if isinstance(v, list):
                object.__setattr__(self, name, tuple(v))

    @property
    def target(self) -> str:
        """`covariate 'mobility'`, `parameter 'beta'` or `transmission`."""
        if self.covariate is not None:
            return f"covariate {self.covariate!r}"
        if self.parameter is not None:
            return f"parameter {self.parameter!r}"
        return "transmission"

    def to_dict(self) -> dict[str, Any]:
        """The TOML-shaped table (fields left at their default omitted)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is None or (f.name == "transmission" and not v):
                continue
            if isinstance(v, _dt.date):
                v = v.isoformat()
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A named list of [`Change`][]s.

    Examples:
        >>> from epifit.forecasting import Change, Scenario
        >>> s = Scenario("distancing", [Change(covariate="mobility", scale=0.7)])
        >>> s.changes[0].target
        "covariate 'mobility'"
    """

    name: str
    changes: tuple[Change, ...] = ()
    description: str = ""

    def __post_init__(self):
        if isinstance(self.changes, list):
            object.__setattr__(self, "changes", tuple(self.changes))
        check_scenario(self, None)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.description:
            out["description"] = self.description
        out["changes"] = [c.to_dict() for c in self.changes]
        return out


@dataclasses.dataclass(frozen=True)
class ScenarioSet:
    """The scenarios of one file (or built in Python), in order.

    Attributes:
        scenarios: the scenarios (names unique).
        days: the horizon in days beyond the data, if the file gives one.
        source: the file they came from (for error messages), or `None`.
    """

    scenarios: tuple[Scenario, ...]
    days: int | None = None
    source: str | None = None

    def __post_init__(self):
        if isinstance(self.scenarios, list):
            object.__setattr__(self, "scenarios", tuple(self.scenarios))
        seen: set[str] = set()
        for s in self.scenarios:
            if not isinstance(s, Scenario):
                raise ScenarioError(
                    f"expected Scenario objects, got {describe_type(s)}",
                    file=self.source,
                    location="scenarios",
                )
            if s.name in seen:
                raise ScenarioError(
                    f"scenario {s.name!r} is defined twice",
                    file=self.source,
                    location=f"scenarios.{s.name}",
                )
            seen.add(s.name)
            check_scenario(s, self.source)
        if self.days is not None and (
            isinstance(self.days, bool)
            or not isinstance(self.days, int)
            or self.days < 0
        ):
            raise ScenarioError(
                f"must be an integer >= 0, got {self.days!r}",
                file=self.source,
                location="days",
            )

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.scenarios)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {} if self.days is None else {"days": self.days}
        out["scenarios"] = {s.name: s.to_dict() for s in self.scenarios}
        return out


# ----------------------------------------------------------------- validation
def _fail(file: str | None, location: str, reason: str) -> ScenarioError:
    return ScenarioError(reason, file=file, location=location)


def check_scenario(s: Scenario, file: str | None) -> None:
    """Check a scenario's structure (not yet against a model): one target and
    one of scale/value per change, fields that suit the target."""
    if not isinstance(s.name, str) or not s.name.strip():
        raise _fail(
            file,
            "scenarios",
            f"a scenario name must be a non-empty string, got {describe_type(s.name)}",
        )
    base = f"scenarios.{s.name}"
    if not isinstance(s.description, str):
        raise _fail(
            file,
            f"{base}.description",
            f"expected a string, got {describe_type(s.description)}",
        )
    if s.name == BASELINE and s.changes:
        raise _fail(
            file,
            f"{base}.changes",
            "'baseline' is the carry-forward reference every forecast includes; "
            "give a scenario with changes another name",
        )
    for i, c in enumerate(s.changes):
        loc = f"{base}.changes[{i}]"
        if not isinstance(c, Change):
            raise _fail(file, loc, f"expected a Change, got {describe_type(c)}")
        _check_change(c, file, loc)


def _check_change(c: Change, file: str | None, loc: str) -> None:
    given = [t for t in TARGETS if getattr(c, t) not in (None, False)]
    if len(given) != 1:
        raise _fail(
            file,
            loc,
            "give exactly one target: covariate = NAME, parameter = NAME or "
            f"transmission = true; got {join(given) if given else 'none'}",
        )
    for name in ("covariate", "parameter"):
        v = getattr(c, name)
        if v is not None and (not isinstance(v, str) or not v):
            raise _fail(file, at(loc, name), f"expected a name, got {describe_type(v)}")
    if not isinstance(c.transmission, bool):
        raise _fail(
            file,
            at(loc, "transmission"),
            f"expected true or false, got {describe_type(c.transmission)}",
        )
    if (c.scale is None) == (c.value is None):
        raise _fail(
            file,
            loc,
            "give exactly one of scale (a factor) or value (a replacement)"
            + ("; got both" if c.scale is not None else ""),
        )
    for name in ("scale", "value"):
        v = getattr(c, name)
        if v is None:
            continue
        if (
            isinstance(v, bool)
            or not isinstance(v, int | float)
            or not math.isfinite(v)
        ):
            raise _fail(
                file, at(loc, name), f"expected a finite number, got {describe_type(v)}"
            )
    if c.scale is not None and c.scale < 0:
        raise _fail(file, at(loc, "scale"), f"must be >= 0, got {c.scale}")
    for name in ("start", "end"):
        v = getattr(c, name)
        if v is None or isinstance(v, _dt.date):
            continue
        if isinstance(v, bool) or not isinstance(v, int | str):
            raise _fail(
                file,
                at(loc, name),
                f"expected a day number or a date, got {describe_type(v)}",
            )
        if isinstance(v, int) and v < 0:
            raise _fail(
                file,
                at(loc, name),
                f"a day number must be >= 0 (day 0 is the first day of the data), "
                f"got {v}",
            )
        if isinstance(v, str):
            parse_date(v, file, at(loc, name))
    for name in ("patches", "inflow", "outflow", "features"):
        v = getattr(c, name)
        if v is None:
            continue
        if not isinstance(v, tuple) or not v:
            raise _fail(
                file,
                at(loc, name),
                f"expected a non-empty list, got {describe_type(v)}",
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
    if c.covariate is None:
        for name in ("features", "inflow", "outflow"):
            if getattr(c, name) is not None:
                raise _fail(
                    file,
                    at(loc, name),
                    f"'{name}' applies to covariates only; this change targets "
                    f"{c.target}",
                )


def parse_date(text: str, file: str | None, location: str) -> _dt.date:
    try:
        return _dt.date.fromisoformat(text.strip())
    except ValueError:
        raise _fail(
            file, location, f"cannot read {text!r} as a date; write YYYY-MM-DD"
        ) from None


# --------------------------------------------------------------------- parsing
class _Reader(Reader):
    error = ScenarioError


def load_scenarios(path: str | os.PathLike) -> ScenarioSet:
    """Read and validate a `SCENARIOS.toml` file (see the module docs).

    Raises:
        FileNotFoundError: no such file.
        ScenarioError: invalid TOML or an invalid scenario, naming the file and
            the field.
    """
    path = Path(path)
    data = _Reader(str(path)).toml_file(path, "Scenario")
    return parse_scenarios(data, file=str(path))


def parse_scenarios(data: Mapping[str, Any], *, file: str | None = None) -> ScenarioSet:
    """Validate scenarios given as a (TOML-shaped) mapping:
    `{"days": 60, "scenarios": {name: {"description": ..., "changes": [...]}}}`.
    """
    r = _Reader(file)
    t = r.table(data, None, required=("scenarios",), optional=("days",))
    days = r.integer(t["days"], "days", 0) if "days" in t else None
    table = r.table(t["scenarios"], "scenarios", optional=tuple(t["scenarios"]))
    if not table:
        raise r.fail("scenarios", "no scenarios defined")
    out = []
    for name, body in table.items():
        loc = f"scenarios.{name}"
        s = r.table(body, loc, optional=SCENARIO_FIELDS)
        desc = ""
        if "description" in s:
            desc = r.string(s["description"], f"{loc}.description")
        raw_changes = (
            r.array(s["changes"], f"{loc}.changes", nonempty=False)
            if "changes" in s
            else []
        )
        changes = []
        for i, ch in enumerate(raw_changes):
            cloc = f"{loc}.changes[{i}]"
            c = r.table(ch, cloc, optional=CHANGE_FIELDS)
            kw: dict[str, Any] = {}
            for key in ("covariate", "parameter"):
                if key in c:
                    kw[key] = r.string(c[key], at(cloc, key))
            if "transmission" in c:
                kw["transmission"] = r.boolean(
                    c["transmission"], at(cloc, "transmission")
                )
            for key in ("scale", "value"):
                if key in c:
                    kw[key] = r.number(c[key], at(cloc, key))
            for key in ("start", "end"):
                if key in c:
                    kw[key] = _day(r, c[key], at(cloc, key))
            for key in ("patches", "inflow", "outflow", "features"):
                if key in c:
                    kw[key] = tuple(r.array(c[key], at(cloc, key)))
            changes.append(Change(**kw))
        try:
            out.append(Scenario(str(name), tuple(changes), desc))
        except ScenarioError as e:
            raise ScenarioError(e.reason, file=file, location=e.location) from None
    return ScenarioSet(tuple(out), days=days, source=file)


def _day(r: _Reader, v: Any, location: str) -> Day:
    if isinstance(v, _dt.datetime):
        if v.time() != _dt.time(0):
            raise r.fail(
                location,
                f"{v.isoformat()} has a time of day; scenarios change whole days, "
                "give a date (YYYY-MM-DD)",
            )
        return v.date()
    if isinstance(v, _dt.date):
        return v
    if isinstance(v, str):
        return parse_date(v, r.file, location)
    return r.integer(v, location, 0)


ScenariosLike = (
    str | os.PathLike | Mapping[str, Any] | Scenario | Sequence[Scenario] | ScenarioSet
)
"""What [`as_scenarios`][] (and `forecast`) accept."""


def as_scenarios(scenarios: ScenariosLike) -> ScenarioSet:
    """A [`ScenarioSet`][] from a file path, a TOML-shaped mapping, one
    [`Scenario`][], a list of them, or a `ScenarioSet`."""
    if isinstance(scenarios, ScenarioSet):
        return scenarios
    if isinstance(scenarios, str | os.PathLike):
        return load_scenarios(scenarios)
    if isinstance(scenarios, Mapping):
        return parse_scenarios(scenarios)
    if isinstance(scenarios, Scenario):
        return ScenarioSet((scenarios,))
    if isinstance(scenarios, Sequence):
        return ScenarioSet(tuple(scenarios))
    raise TypeError(
        "scenarios must be a SCENARIOS.toml path, a mapping, a Scenario, a list of "
        f"Scenarios or a ScenarioSet; got {type(scenarios).__name__}."
    )
