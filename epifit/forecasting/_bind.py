"""Scenarios bound to a model, its patches and covariates, and a horizon.

Binding checks every name, label and day against the model and the data and
turns each scenario into arrays of one common structure, so that all
scenarios (and all parameter samples) run through one compiled function:

* `covariates`: every covariate over the whole horizon, `(time, ...)`, the
  last observed day carried forward (the baseline rule), then changed;
* `parameters`: per changed parameter, `scale` and `value` (NaN: keep) on
  the *intervals* between parameter-change days, `(interval, *shape)`;
* `transmission`: `scale` and `value` (NaN: keep) per day and patch (per
  cell with `[strata]`: a change to a patch changes all its strata).

The parameter-change days of all scenarios together cut the horizon into
intervals; in a scenario that leaves a parameter alone, its scale is 1 there.
Each change checks and binds itself ([`AbstractChange.bind`][]) and writes
itself into a scenario's arrays ([`AbstractChange.apply`][]).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from epifit.forecasting._change import (
    AbstractChange,
    ParameterChange,
    TransmissionChange,
)
from epifit.forecasting._context import BindContext, ScenarioArrays
from epifit.forecasting._covariate import host_covariate
from epifit.forecasting._error import ScenarioError
from epifit.forecasting._horizon import Horizon
from epifit.forecasting._scenario import BASELINE, Scenario, ScenarioSet
from epifit.model import CompiledModel

__all__ = ["BoundScenarios", "bind_scenarios"]


@dataclasses.dataclass(frozen=True)
class _Bound:
    """A change with its days and the entries it touches."""

    index: int
    change: AbstractChange
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
    _bound: list[list[_Bound]]
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
        arrays = ScenarioArrays(
            covariates=dict(self._covariates),
            parameters={
                n: {
                    "scale": np.ones((self.n_intervals, *s)),
                    "value": np.full((self.n_intervals, *s), np.nan),
                }
                for n, s in self._shapes.items()
            },
            transmission={
                "scale": np.ones((T, self._n_patches)),
                "value": np.full((T, self._n_patches), np.nan),
            },
            interval_starts=np.asarray((0, *self.breaks)),
        )
        for b in self._bound[i]:
            b.change.apply(b.start, b.end, b.entries, arrays)
        out: dict[str, Any] = {"covariates": arrays.covariates}
        if self.parameters:
            out["parameters"] = arrays.parameters
        if self.transmission:
            out["transmission"] = arrays.transmission
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
    ctx = BindContext.of(
        model, patches, covariates, values, horizon, feature_labels, scenarios.source
    )
    listed = list(scenarios.scenarios)
    if baseline and BASELINE not in scenarios.names:
        note = "the last observed covariates carried forward, parameters as fitted"
        listed.insert(0, Scenario(BASELINE, (), note))
    bound = [_bind_scenario(s, ctx) for s in listed]
    changes = [b for bs in bound for b in bs]
    shapes = {
        b.change.parameter: np.shape(values[b.change.parameter])
        for b in changes
        if isinstance(b.change, ParameterChange)
    }
    T = horizon.n_days
    changed_days = {
        d
        for b in changes
        if isinstance(b.change, ParameterChange)
        for d in (b.start, b.end)
    }
    breaks = sorted(d for d in changed_days if 0 < d < T)
    interval_of_day = np.searchsorted(np.asarray(breaks, int), np.arange(T), "right")
    cov = {
        c.name: host_covariate(covariates[c.name], T if c.time_varying else None)
        for c in model.spec.covariates
    }
    return BoundScenarios(
        names=tuple(s.name for s in listed),
        descriptions=tuple(s.description for s in listed),
        horizon=horizon,
        breaks=tuple(int(b) for b in breaks),
        interval_of_day=interval_of_day.astype(np.int64),
        parameters=tuple(sorted(shapes)),
        transmission=any(isinstance(b.change, TransmissionChange) for b in changes),
        definitions={s.name: s.to_dict() for s in listed},
        _bound=bound,
        _covariates=cov,
        _shapes={k: shapes[k] for k in sorted(shapes)},
        _n_patches=ctx.n_cells,
    )


def _bind_scenario(s: Scenario, ctx: BindContext) -> list[_Bound]:
    """The changes of scenario `s` bound to `ctx`, checked for overlaps."""
    bound = []
    for i, c in enumerate(s.changes):
        loc = f"scenarios.{s.name}.changes[{i}]"
        entries = c.bind(ctx, loc)
        start, end = ctx.horizon.window(c.start, c.end, ctx.file, loc)
        bound.append(_Bound(i, c, start, end, entries))
    _check_conflicts(bound, s.name, ctx.horizon, ctx.file)
    return bound


def _check_conflicts(
    bound: list[_Bound], scenario: str, horizon: Horizon, file: str | None
) -> None:
    for a, b in itertools.combinations(bound, 2):
        if a.change.target != b.change.target:
            continue
        lo, hi = max(a.start, b.start), min(a.end, b.end)
        if lo >= hi or not np.any(a.entries & b.entries):
            continue
        raise ScenarioError(
            f"changes[{a.index}] and changes[{b.index}] both change "
            f"{a.change.target} for some of the same entries on "
            f"{horizon.label(lo)} .. {horizon.label(hi - 1)}; overlapping changes "
            "are ambiguous: give them disjoint days, patches or features",
            file=file,
            location=f"scenarios.{scenario}.changes[{b.index}]",
        )
