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
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from epifit._errors import describe_type
from epifit._toml import Reader, at, join
from epifit.forecasting._change import (
    TABLE_FIELDS,
    AbstractChange,
    ParameterChange,
    TransmissionChange,
)
from epifit.forecasting._covariate import CovariateChange
from epifit.forecasting._error import ScenarioError
from epifit.forecasting._horizon import Day, parse_date

__all__ = [
    "BASELINE",
    "Change",
    "Scenario",
    "ScenarioSet",
    "ScenariosLike",
    "as_scenarios",
    "load_scenarios",
    "make_change",
    "parse_scenarios",
]

BASELINE = "baseline"
SCENARIO_FIELDS = ("description", "changes")
KINDS: dict[str, type[AbstractChange]] = {
    "covariate": CovariateChange,
    "parameter": ParameterChange,
    "transmission": TransmissionChange,
}
"""The target fields of a change's table and the kind of change each makes."""
COVARIATE_ONLY = ("features", "inflow", "outflow")


def _fail(file: str | None, location: str | None, reason: str) -> ScenarioError:
    return ScenarioError(reason, file=file, location=location)


# --------------------------------------------------------------------- changes
def make_change(
    fields: Mapping[str, Any], file: str | None = None, loc: str | None = None
) -> AbstractChange:
    """The change that `fields` (a change's TOML table, or [`Change`][]'s
    arguments) describe: its one target picks the final class. The rest is
    checked where the change's place is known ([`check_scenario`][]).

    Raises:
        ScenarioError: no target or several, a `transmission` that is not a
            boolean, or covariate fields for another target (at `loc`).
    """
    given = [t for t in KINDS if fields.get(t) not in (None, False)]
    if len(given) != 1:
        raise _fail(
            file,
            loc,
            "give exactly one target: covariate = NAME, parameter = NAME or "
            f"transmission = true; got {join(given) if given else 'none'}",
        )
    (target,) = given
    if target == "transmission" and not isinstance(fields[target], bool):
        raise _fail(
            file,
            at(loc, "transmission"),
            f"expected true or false, got {describe_type(fields[target])}",
        )
    cls = KINDS[target]
    change = cls(
        **{k: fields[k] for k in cls.table_fields if fields.get(k) is not None}
    )
    for name in COVARIATE_ONLY:
        if name not in cls.table_fields and fields.get(name) is not None:
            raise _fail(
                file,
                at(loc, name),
                f"'{name}' applies to covariates only; this change targets "
                f"{change.target}",
            )
    return change


def Change(
    covariate: str | None = None,
    parameter: str | None = None,
    transmission: bool = False,
    scale: float | None = None,
    value: float | None = None,
    start: Day = None,
    end: Day = None,
    patches: Sequence[str] | None = None,
    features: Sequence[int | str] | None = None,
    inflow: Sequence[str] | None = None,
    outflow: Sequence[str] | None = None,
) -> AbstractChange:
    """One modification of a scenario, as a [`CovariateChange`][],
    [`ParameterChange`][] or [`TransmissionChange`][] by its target: give
    exactly one target (`covariate`, `parameter` or `transmission=True`) and
    exactly one of `scale` (a factor >= 0) or `value` (a replacement).

    Args:
        covariate: a time-varying covariate of the model, e.g. `"mobility"`.
        parameter: a model parameter, e.g. `"beta"` (constrained scale).
        transmission: change the transmission rate of every infection.
        scale, value, start, end, patches: see [`AbstractChange`][].
        features, inflow, outflow: see [`CovariateChange`][].

    Raises:
        ScenarioError: no target or several, or covariate fields for another
            target; the other fields are checked by the scenario.

    Examples:
        >>> from epifit.forecasting import Change
        >>> Change(covariate="mobility", scale=0.7).target
        "covariate 'mobility'"
    """
    return make_change(
        dict(
            covariate=covariate,
            parameter=parameter,
            transmission=transmission,
            scale=scale,
            value=value,
            start=start,
            end=end,
            patches=patches,
            features=features,
            inflow=inflow,
            outflow=outflow,
        )
    )


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A named list of changes ([`AbstractChange`][]s, made by [`Change`][]).

    Examples:
        >>> from epifit.forecasting import Change, Scenario
        >>> s = Scenario("distancing", [Change(covariate="mobility", scale=0.7)])
        >>> s.changes[0].target
        "covariate 'mobility'"
    """

    name: str
    changes: tuple[AbstractChange, ...] = ()
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
        if not isinstance(c, AbstractChange):
            raise _fail(file, loc, f"expected a Change, got {describe_type(c)}")
        c.check(file, loc)


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
        changes = [
            _read_change(r, ch, f"{loc}.changes[{i}]")
            for i, ch in enumerate(raw_changes)
        ]
        try:
            out.append(Scenario(str(name), tuple(changes), desc))
        except ScenarioError as e:
            raise ScenarioError(e.reason, file=file, location=e.location) from None
    return ScenarioSet(tuple(out), days=days, source=file)


def _read_change(r: _Reader, table: Any, loc: str) -> AbstractChange:
    """The change of the TOML table at `loc`, its fields read by type."""
    c = r.table(table, loc, optional=TABLE_FIELDS)
    kw: dict[str, Any] = {}
    for key in ("covariate", "parameter"):
        if key in c:
            kw[key] = r.string(c[key], at(loc, key))
    if "transmission" in c:
        kw["transmission"] = r.boolean(c["transmission"], at(loc, "transmission"))
    for key in ("scale", "value"):
        if key in c:
            kw[key] = r.number(c[key], at(loc, key))
    for key in ("start", "end"):
        if key in c:
            kw[key] = _day(r, c[key], at(loc, key))
    for key in ("patches", "inflow", "outflow", "features"):
        if key in c:
            kw[key] = tuple(r.array(c[key], at(loc, key)))
    return make_change(kw, r.file, loc)


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
