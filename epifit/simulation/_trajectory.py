"""The numbers of a trajectory file beyond its states, and their variables.

[`trajectory_numbers`][] computes them (the predicted observations at their
stamps, the reproduction number, the derived series) from a parameter pytree
and the states of a solve; it is traceable, so a caller that has a compiled
program at hand (a fit's output program, `epifit.fitting`) computes them
there, with the problem's data passed as traced `arrays`, and hands the
NumPy results to `trajectory_dataset(..., numbers=...)`, which then runs no
JAX operation. Without `numbers`, `trajectory_dataset` computes them here,
eagerly.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from epifit.data import PATCH, TIME
from epifit.model import derived_series, has_reproduction_number, reproduction_number
from epifit.simulation._problem import Problem

__all__ = ["reproduction_vars", "series_vars", "trajectory_numbers"]


def trajectory_numbers(problem: Problem, params, ys, arrays=None) -> dict[str, Any]:
    """`{"predicted": {observation: (stamp, cell)}, "reproduction": {"R_eff":
    (time, cell), "R_eff_total": (time,)}, "series": {name: (time, cell)}}`
    along the states `ys` at `params` (no solve). `reproduction` is left out
    for a model whose reproduction number is not defined. Traceable in
    `params`, `ys` and `arrays` (default `problem.arrays`: the covariates and
    the weekday index the predictions read)."""
    arrays = problem.arrays if arrays is None else arrays
    model = problem.model
    covariates = arrays["covariates"]
    out = {"predicted": problem.predict(params, ys, arrays)}
    if has_reproduction_number(model):
        out["reproduction"] = reproduction_number(
            model, ys, params, covariates, ts=problem.ts
        )
    out["series"] = derived_series(model, ys, params, covariates)
    return out


def in_order(values: Mapping[str, Any], names: Iterable[str]) -> list[str]:
    """The keys of `values` in the order of `names`, then any others (a
    compiled program's output dict comes back with sorted keys)."""
    names = [n for n in names if n in values]
    return names + [k for k in values if k not in names]


def cells(problem: Problem, each: bool = True) -> tuple[str, ...]:
    """The dims of the structure axis in the output: `(patch,)`, or `(patch,
    STRATUM)` for the cells of a model with `[strata]`."""
    strata = problem.spec.strata
    return (PATCH,) if strata is None or not each else (PATCH, strata.name)


def on_cells(problem: Problem, a: np.ndarray, each: bool = True) -> np.ndarray:
    """`(..., cell)` as `(..., patch, stratum)` with `[strata]`."""
    if problem.spec.strata is None or not each:
        return a
    return a.reshape(*a.shape[:-1], problem.n_patches, problem.model.n_strata)


def series_vars(problem: Problem, series: Mapping[str, Any]) -> dict[str, tuple]:
    """The derived series (`[derived]` reading the state or covariates) along
    the trajectory, `(time, patch[, stratum])` each, from `series`
    (`trajectory_numbers`)."""
    source = {d.name: d.expression.source for d in problem.spec.series}
    return {
        name: (
            (TIME, *cells(problem)),
            on_cells(problem, np.asarray(series[name], np.float64)),
            {"long_name": f"derived series {name} = {source[name]}"},
        )
        for name in in_order(series, source)
    }


def reproduction_vars(problem: Problem, r: Mapping[str, Any] | None) -> dict:
    """`R_eff (time, patch)` and `R_eff_total (time)` along the trajectory
    (`epifit.model.reproduction_number`) from `r` (`trajectory_numbers`;
    None for a model whose reproduction number is not defined: nothing)."""
    if r is None:
        return {}
    what = (
        "the next-generation matrix at each day's susceptibles and rates "
        "(docs/models.md, 'The reproduction number')"
    )
    return {
        "R_eff": (
            (TIME, *cells(problem)),
            on_cells(problem, np.asarray(r["R_eff"], np.float64)),
            {
                "long_name": "effective reproduction number of a new infection "
                "in the patch (infections caused in all patches)",
                "units": "1",
                "comment": f"column sums of {what}",
            },
        ),
        "R_eff_total": (
            (TIME,),
            np.asarray(r["R_eff_total"], np.float64),
            {
                "long_name": "effective reproduction number, all patches",
                "units": "1",
                "comment": f"spectral radius of {what}",
            },
        ),
    }
