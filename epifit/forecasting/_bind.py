"""Scenarios bound to a model, its patches and covariates, and a horizon.

Binding checks every name, label and day against the model and the data and
turns each scenario into arrays of one common structure, so that all
scenarios (and all parameter samples) run through one compiled function:

* `covariates`: every covariate over the whole horizon, `(time, ...)`, the
  last observed day carried forward (the baseline rule), then changed;
* `parameters`: per changed parameter, `scale` and `value` (NaN: keep) on
  the *intervals* between parameter-change days, `(interval, *shape)`;
* `transmission`: `scale` and `value` (NaN: keep) per day and patch.

The parameter-change days of all scenarios together cut the horizon into
intervals; in a scenario that leaves a parameter alone, its scale is 1 there.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from epifit._toml import join
from epifit.data import FEATURE, PATCH, PATCH_TO
from epifit.forecasting._scenario import (
    BASELINE,
    Change,
    Scenario,
    ScenarioError,
    ScenarioSet,
    parse_date,
)
from epifit.model import CompiledModel, SparseCoupling

__all__ = ["BoundScenarios", "Horizon", "bind_scenarios", "carry_forward"]


def _labels(items: Sequence[str], limit: int = 20) -> str:
    items = [str(x) for x in items]
    return join(items if len(items) <= limit else items[:limit] + ["..."])


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


def carry_forward(a: np.ndarray, n_days: int) -> np.ndarray:
    """`a (time, ...)` over `n_days` days: the last day repeated (or cut)."""
    a = np.asarray(a)
    if a.shape[0] >= n_days:
        return a[:n_days]
    tail = np.repeat(a[-1:], n_days - a.shape[0], axis=0)
    return np.concatenate([a, tail], axis=0)


def _host(v: Any, n_days: int | None) -> np.ndarray | SparseCoupling:
    """A covariate as NumPy (a `SparseCoupling` keeps its storage), carried
    forward over `n_days` when it varies in time."""
    if isinstance(v, SparseCoupling):
        values = np.asarray(v.values)
        if n_days is not None:
            values = carry_forward(values, n_days)
        return SparseCoupling(values, np.asarray(v.columns))
    a = np.asarray(v)
    return a if n_days is None else carry_forward(a, n_days)


def _links(v: np.ndarray | SparseCoupling) -> np.ndarray:
    """`(patch, patch_to)`: the entries of a coupling that are non-zero on
    some day (the existing links)."""
    if isinstance(v, SparseCoupling):
        n = v.columns.shape[0]
        out = np.zeros((n, n), bool)
        nonzero = np.any(v.values != 0, axis=tuple(range(v.values.ndim - 2)))
        rows = np.broadcast_to(np.arange(n)[:, None], v.columns.shape)
        out[rows[nonzero], v.columns[nonzero]] = True
        return out
    return np.any(v != 0, axis=tuple(range(v.ndim - 2)))


def _change_covariate(v, start: int, end: int, entries: np.ndarray, c: Change):
    """A copy of covariate `v` (dense or sparse) with change `c` applied on days
    `start .. end - 1` to `entries` (a mask over the dense non-time axes)."""
    if isinstance(v, SparseCoupling):
        values = np.array(v.values, copy=True)
        cols = np.asarray(v.columns)
        stored = entries[np.arange(cols.shape[0])[:, None], cols]
        block = values[start:end]
        if c.scale is not None:
            block[:, stored] *= c.scale
        else:
            block[:, stored] = c.value
        return SparseCoupling(values, cols)
    a = np.array(v, copy=True)
    block = a[start:end]
    if c.scale is not None:
        block[:, entries] *= c.scale
    else:
        block[:, entries] = c.value
    return a


@dataclasses.dataclass(frozen=True)
class _Resolved:
    """A change with its days and the entries it touches."""

    index: int
    change: Change
    kind: str  # covariate | parameter | transmission
    name: str  # covariate or parameter name ("" for transmission)
    start: int
    end: int
    entries: np.ndarray  # bool over the non-time axes of the target


@dataclasses.dataclass
class BoundScenarios:
    """Scenarios checked against a model and turned into arrays.

    Attributes:
        names, descriptions: one per scenario (`baseline` first).
        horizon: the days.
        breaks: the parameter-change days (`0 < day < n_days`), sorted.
        interval_of_day: `(time,)` the interval each day belongs to.
        parameters: the names of the parameters any scenario changes.
        transmission: whether any scenario changes transmission.
        definitions: the scenarios as TOML-shaped tables (provenance).
    """

    names: tuple[str, ...]
    descriptions: tuple[str, ...]
    horizon: Horizon
    breaks: tuple[int, ...]
    interval_of_day: np.ndarray
    parameters: tuple[str, ...]
    transmission: bool
    definitions: dict[str, Any]
    _resolved: list[list[_Resolved]]
    _covariates: dict[str, np.ndarray]
    _shapes: dict[str, tuple[int, ...]]
    _n_patches: int

    @property
    def n_intervals(self) -> int:
        return len(self.breaks) + 1

    def data(self, i: int) -> dict[str, Any]:
        """Scenario `i` as arrays (NumPy): `covariates`, and `parameters` /
        `transmission` when any scenario changes them."""
        T = self.horizon.n_days
        starts = np.asarray((0, *self.breaks))
        cov = dict(self._covariates)
        par = {
            n: {
                "scale": np.ones((self.n_intervals, *s)),
                "value": np.full((self.n_intervals, *s), np.nan),
            }
            for n, s in self._shapes.items()
        }
        tr = {
            "scale": np.ones((T, self._n_patches)),
            "value": np.full((T, self._n_patches), np.nan),
        }
        for r in self._resolved[i]:
            c = r.change
            if r.kind == "covariate":
                cov[r.name] = _change_covariate(
                    cov[r.name], r.start, r.end, r.entries, c
                )
            elif r.kind == "parameter":
                rows = (starts >= r.start) & (starts < r.end)
                sel = np.ix_(rows, *np.nonzero(r.entries)) if r.entries.ndim else rows
                field = "scale" if c.scale is not None else "value"
                par[r.name][field][sel] = c.scale if c.scale is not None else c.value
            else:
                field = "scale" if c.scale is not None else "value"
                v = c.scale if c.scale is not None else c.value
                tr[field][r.start : r.end, r.entries] = v
        out: dict[str, Any] = {"covariates": cov}
        if self.parameters:
            out["parameters"] = par
        if self.transmission:
            out["transmission"] = tr
        return out


def bind_scenarios(
    scenarios: ScenarioSet,
    *,
    model: CompiledModel,
    patches: Sequence[str],
    covariates: Mapping[str, Any],
    values: Mapping[str, Any],
    horizon: Horizon,
    feature_labels: Mapping[str, Sequence[str]] | None = None,
    baseline: bool = True,
) -> BoundScenarios:
    """Check scenarios against a model, its data and a horizon; see the module.

    Args:
        scenarios: the scenarios.
        model: the compiled model.
        patches: the patch labels, in order.
        covariates: the data's covariates by name (`(time, ...)` day-major).
        values: constrained parameter values (the point estimate), to check
            scaled parameters against their bounds.
        horizon: the days.
        feature_labels: labels of a covariate's feature axis, when the data
            have them.
        baseline: put a `baseline` (no changes) first, unless the scenarios
            define one.

    Raises:
        ScenarioError: naming the file, the field and what is wrong.
    """
    file = scenarios.source
    spec = model.spec
    T = horizon.n_days
    patches = [str(p) for p in patches]
    patch_index = {p: k for k, p in enumerate(patches)}
    listed = list(scenarios.scenarios)
    if baseline and BASELINE not in scenarios.names:
        note = "the last observed covariates carried forward, parameters as fitted"
        listed.insert(0, Scenario(BASELINE, (), note))
    cov_specs = {c.name: c for c in spec.covariates}
    params = {p.name: p for p in spec.parameters}
    derived = {d.name for d in spec.derived}
    neural = {n.name for n in spec.neural}
    time_varying = sorted(c.name for c in spec.covariates if c.time_varying)
    feature_labels = dict(feature_labels or {})

    def fail(loc: str, reason: str) -> ScenarioError:
        return ScenarioError(reason, file=file, location=loc)

    def select(labels, loc, what) -> np.ndarray:
        mask = np.zeros(len(patches), bool)
        for k, lab in enumerate(labels):
            if lab not in patch_index:
                raise fail(
                    f"{loc}[{k}]",
                    f"unknown patch {lab!r}; the data's {len(patches)} patches: "
                    f"{_labels(patches)}",
                )
            mask[patch_index[lab]] = True
        return mask

    def entries_covariate(c: Change, loc: str) -> np.ndarray:
        name = c.covariate
        if name not in cov_specs:
            hint = ""
            if name in params or name in neural:
                hint = f" ({name!r} is a parameter: use parameter = {name!r})"
            raise fail(
                f"{loc}.covariate",
                f"unknown covariate {name!r}{hint}; the model's time-varying "
                f"covariates: {join(time_varying)}",
            )
        cs = cov_specs[name]
        if not cs.time_varying:
            raise fail(
                f"{loc}.covariate",
                f"covariate {name!r} (dims {', '.join(cs.dims)}) does not vary in "
                f"time; scenarios change time-varying covariates: "
                f"{join(time_varying)}",
            )
        dims = cs.dims[1:]
        shape = tuple(covariates[name].shape)[1:]
        for field, dim in (("features", FEATURE), ("inflow", PATCH_TO)):
            if getattr(c, field) is not None and dim not in dims:
                raise fail(
                    f"{loc}.{field}",
                    f"covariate {name!r} has dims ({', '.join(cs.dims)}): no "
                    f"{dim} axis for '{field}'",
                )
        if c.outflow is not None and PATCH_TO not in dims:
            raise fail(
                f"{loc}.outflow",
                f"covariate {name!r} has dims ({', '.join(cs.dims)}): no "
                f"{PATCH_TO} axis for 'outflow'",
            )
        if c.patches is not None and PATCH_TO in dims:
            raise fail(
                f"{loc}.patches",
                f"covariate {name!r} couples patches: give inflow (rows: what "
                "reaches the patches) and/or outflow (columns: what leaves them)",
            )
        if c.patches is not None and PATCH not in dims:
            raise fail(
                f"{loc}.patches",
                f"covariate {name!r} has dims ({', '.join(cs.dims)}): no patch axis",
            )
        if PATCH_TO in dims:
            out = np.ones(shape, bool)
            if c.inflow is not None or c.outflow is not None:
                rows = np.zeros(len(patches), bool)
                cols = np.zeros(len(patches), bool)
                if c.inflow is not None:
                    rows = select(c.inflow, f"{loc}.inflow", "inflow")
                if c.outflow is not None:
                    cols = select(c.outflow, f"{loc}.outflow", "outflow")
                out = rows[:, None] | cols[None, :]
            if c.value is not None:  # replace weights of existing links only
                out &= _links(_host(covariates[name], None))
            return out
        axes = []
        for dim, size in zip(dims, shape, strict=True):
            m = np.ones(size, bool)
            if dim == PATCH and c.patches is not None:
                m = select(c.patches, f"{loc}.patches", "patches")
            elif dim == FEATURE and c.features is not None:
                labels = [str(x) for x in feature_labels.get(name, ())]
                m = _features(c.features, labels, size, name, f"{loc}.features", fail)
            axes.append(m)
        out = np.ones(shape, bool)
        for k, m in enumerate(axes):
            out &= m.reshape([-1 if j == k else 1 for j in range(len(shape))])
        return out

    def entries_parameter(c: Change, loc: str) -> np.ndarray:
        name = c.parameter
        if name not in params:
            if name in derived:
                why = (
                    f"{name!r} is a derived quantity; change the parameters it is "
                    "computed from"
                )
            elif name in neural:
                why = (
                    f"{name!r} is a neural sub-model; to change the rate it gives, "
                    "use transmission = true (or change its covariate)"
                )
            else:
                why = f"unknown parameter {name!r}"
            raise fail(
                f"{loc}.parameter", f"{why}; the model's parameters: {join(params)}"
            )
        p = params[name]
        est = np.asarray(values[name], np.float64)
        if c.patches is not None and not p.per_patch:
            raise fail(
                f"{loc}.patches",
                f"parameter {name!r} is not per patch; leave out 'patches'",
            )
        mask = (
            select(c.patches, f"{loc}.patches", "patches")
            if c.patches is not None
            else np.ones(est.shape, bool)
        )
        lo, hi = p.bounds
        new = est * c.scale if c.scale is not None else np.full(est.shape, c.value)
        bad = (new < lo) | (new > hi)
        if np.any(bad & mask):
            v = float(np.ravel(new[bad & mask])[0])
            what = (
                f"scaling {name!r} by {c.scale} gives {v:.6g}"
                if c.scale is not None
                else f"value {v:.6g}"
            )
            field = "scale" if c.scale is not None else "value"
            raise fail(
                f"{loc}.{field}",
                f"{what}, outside the parameter's range [{lo}, {hi}]",
            )
        return mask

    resolved: list[list[_Resolved]] = []
    shapes: dict[str, tuple[int, ...]] = {}
    any_transmission = False
    for s in listed:
        rs = []
        for i, c in enumerate(s.changes):
            loc = f"scenarios.{s.name}.changes[{i}]"
            if c.covariate is not None:
                kind, name, entries = (
                    "covariate",
                    c.covariate,
                    entries_covariate(c, loc),
                )
            elif c.parameter is not None:
                kind, name = "parameter", c.parameter
                entries = entries_parameter(c, loc)
                shapes[name] = np.shape(values[name])
            else:
                if not spec.infections:
                    raise fail(
                        f"{loc}.transmission",
                        f"model {spec.name!r} has no infections to change",
                    )
                kind, name = "transmission", ""
                entries = (
                    select(c.patches, f"{loc}.patches", "patches")
                    if c.patches is not None
                    else np.ones(len(patches), bool)
                )
                any_transmission = True
            start, end = _days(c, loc, horizon, file)
            rs.append(_Resolved(i, c, kind, name, start, end, entries))
        _check_conflicts(rs, s.name, horizon, file)
        resolved.append(rs)

    changed_days = {
        d
        for rs in resolved
        for r in rs
        if r.kind == "parameter"
        for d in (r.start, r.end)
    }
    breaks = sorted(d for d in changed_days if 0 < d < T)
    interval_of_day = np.searchsorted(np.asarray(breaks, int), np.arange(T), "right")
    cov = {
        c.name: _host(covariates[c.name], T if c.time_varying else None)
        for c in spec.covariates
    }
    return BoundScenarios(
        names=tuple(s.name for s in listed),
        descriptions=tuple(s.description for s in listed),
        horizon=horizon,
        breaks=tuple(int(b) for b in breaks),
        interval_of_day=interval_of_day.astype(np.int64),
        parameters=tuple(sorted(shapes)),
        transmission=any_transmission,
        definitions={s.name: s.to_dict() for s in listed},
        _resolved=resolved,
        _covariates=cov,
        _shapes={k: shapes[k] for k in sorted(shapes)},
        _n_patches=len(patches),
    )


def _features(features, labels, size, name, loc, fail) -> np.ndarray:
    """The feature axis mask of a change (indices, or labels when the data
    label the features)."""
    m = np.zeros(size, bool)
    for k, f in enumerate(features):
        if isinstance(f, str):
            if f not in labels:
                have = (
                    f"features {_labels(labels)}"
                    if labels
                    else f"no feature labels: give indices 0..{size - 1}"
                )
                raise fail(
                    f"{loc}[{k}]",
                    f"unknown feature {f!r}; covariate {name!r} has {have}",
                )
            m[labels.index(f)] = True
        elif not 0 <= f < size:
            raise fail(
                f"{loc}[{k}]",
                f"feature index {f} is out of range; covariate {name!r} has "
                f"{size} features (0..{size - 1})",
            )
        else:
            m[f] = True
    return m


def _days(c: Change, loc: str, horizon: Horizon, file: str | None) -> tuple[int, int]:
    T = horizon.n_days
    start = (
        horizon.n_fit if c.start is None else horizon.day(c.start, file, f"{loc}.start")
    )
    end = T if c.end is None else horizon.day(c.end, file, f"{loc}.end")
    span = f"the horizon is {horizon.describe()}"
    if not 0 <= start < T:
        given = "the first forecast day" if c.start is None else horizon.label(start)
        raise ScenarioError(
            f"start {given} is outside the horizon; {span}"
            + (" (no forecast days: give days > 0)" if c.start is None else ""),
            file=file,
            location=f"{loc}.start",
        )
    if not start < end <= T:
        raise ScenarioError(
            f"end {horizon.label(end)} must lie after the start "
            f"{horizon.label(start)} and at most one day past the horizon's last "
            f"day; {span}",
            file=file,
            location=f"{loc}.end",
        )
    return start, end


def _check_conflicts(
    rs: list[_Resolved], scenario: str, horizon: Horizon, file: str | None
) -> None:
    for a, b in itertools.combinations(rs, 2):
        if (a.kind, a.name) != (b.kind, b.name):
            continue
        lo, hi = max(a.start, b.start), min(a.end, b.end)
        if lo >= hi or not np.any(a.entries & b.entries):
            continue
        what = a.change.target
        raise ScenarioError(
            f"changes[{a.index}] and changes[{b.index}] both change {what} for some "
            f"of the same entries on {horizon.label(lo)} .. {horizon.label(hi - 1)}; "
            "overlapping changes are ambiguous: give them disjoint days, patches or "
            "features",
            file=file,
            location=f"scenarios.{scenario}.changes[{b.index}]",
        )
