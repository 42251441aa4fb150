"""`simulate`: a model run as an xarray Dataset."""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import os
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import equinox as eqx
import jax
import numpy as np
import xarray as xr

from epifit._stored import stored
from epifit.data import PATCH, TIME, DataError
from epifit.model import parameters_json
from epifit.simulation._noise import noise_of
from epifit.simulation._observe import DEFAULT_START, add_observations, set_dates
from epifit.simulation._problem import Problem
from epifit.simulation._settings import SolverSettings
from epifit.simulation._trajectory import (
    cells,
    in_order,
    on_cells,
    reproduction_vars,
    series_vars,
    trajectory_numbers,
)

_DIMENSIONLESS = (
    "dimensionless (CF '1'): counts or fractions of each patch's population, as "
    "the model's initial state; the model file does not declare which"
)
_UNDECLARED = ("1", "dimensionless (CF '1'): the data variable declares no units")
# the provenance attributes a simulation takes from `SolverSettings.to_dict()`
_SOLVER_ATTRS = ("solver", "stepsize_controller", "rtol", "atol")


def epifit_version() -> str:
    try:
        return importlib.metadata.version("epifit")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover
        return "unknown"


def load_params(problem: Problem, source: str | os.PathLike | Mapping[str, Any] | None):
    """Unconstrained parameters from the model's initial values, overridden by
    constrained values from a mapping or a TOML/JSON file (`name = value`,
    per-patch parameters as lists)."""
    params = problem.init_params()
    if source is None:
        return params
    if isinstance(source, str | os.PathLike):
        from epifit._toml import read_values_file

        path = Path(source)
        values = read_values_file(
            path, lambda e: DataError(f"{path}: cannot parse parameters: {e}")
        )
        where = str(path)
    else:
        values, where = dict(source), "params"
    known = {p.name for p in problem.spec.parameters}
    neural = {n.name for n in problem.spec.neural}
    if set(values) & neural:
        raise DataError(
            f"{where}: {sorted(set(values) & neural)} are neural sub-models; their "
            "weights come from a fit (FIT.nc), not from a table of values"
        )
    unknown = sorted(set(values) - known)
    if unknown:
        raise DataError(
            f"{where}: unknown parameters {unknown}; the model has {sorted(known)}"
        )
    current = problem.model.constrain(params)
    merged = {k: current[k] for k in known | neural}
    varying = problem.model.time_varying_parameters
    for k, v in values.items():
        arr = np.asarray(v, dtype=np.float64)
        expected = np.shape(current[k])
        # a time-varying parameter also takes one value for every day
        constant = expected[1:] if k in varying else None
        if arr.shape != expected and arr.shape != () and arr.shape != constant:
            raise DataError(
                f"{where}: parameter '{k}' has shape {arr.shape}; expected {expected}"
            )
        if k in varying and arr.shape != expected:
            merged[k] = np.broadcast_to(arr, constant)
        else:
            merged[k] = np.broadcast_to(arr, expected)
    try:
        new = problem.model.unconstrain(merged)
    except ValueError as e:  # a value outside its parameter's range
        raise DataError(f"{where}: {e}") from None
    out = {**params, **{k: new[k] for k in known}}
    # a rate or probability that these values take out of its range
    model = problem.model
    if broken := model.range_violations(model.constrain(out), model.daily_values(out)):
        raise DataError(f"{where}: these values break the model: {broken[0]}")
    return out


def model_text(path: str | os.PathLike | None) -> str:
    """The model file's text exactly as its bytes (no newline translation, so
    that its SHA-256 is the file's `model_sha256`), or "" without a file."""
    if not path or not Path(path).is_file():
        return ""
    return Path(path).read_bytes().decode("utf-8", errors="replace")


def _absolute(path: str | os.PathLike | None) -> str:
    """The absolute form of a path (stored beside the path as given, so that a
    file written elsewhere still finds it), or ""."""
    return str(Path(path).resolve()) if path else ""


def simulate(
    model,
    data=None,
    params=None,
    *,
    values: str | os.PathLike | Mapping[str, Any] | None = None,
    days: int | None = None,
    n_patches: int | None = None,
    settings: SolverSettings | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    solver=None,
    observe: str | None = None,
    seed: int = 0,
    start=None,
) -> xr.Dataset:
    """Run a model with given (or its initial) parameters; return the trajectories.

    Args:
        model: a TOML path, `ModelSpec` or `CompiledModel`.
        data: a dataset or netCDF path with the model's covariates and initial
            data (observations, if present, are copied alongside).
        params: unconstrained parameters (a pytree from `init_params` or a fit);
            default the model's initial values.
        values: constrained parameter values overriding those, as a mapping or
            a TOML/JSON file of `name = value` (per-patch ones as lists).
        days: days to simulate (default: the data's).
        n_patches: patches, for a model run without data.
        settings: how the model is solved (default `SolverSettings()`: Tsit5
            with a PID controller at its default tolerances).
        rtol, atol: the PID controller's tolerances, replacing those of
            `settings`.
        solver: a solver (or its name) replacing that of `settings`, e.g.
            `Kvaerno5()` for stiff models.
        observe: add synthetic observations: `"model"` draws each observation
            from its own family at the parameter values (its dispersion, sd or
            least-squares weight), `"poisson"`, `"negative_binomial"` or
            `"gaussian"` one family for all (see `epifit.simulation.sample_noise`).
            The noisy series are written under the observations' own names
            (NaN off their stamps, with a `period` attribute), the time axis
            is dated, and the covariates and initial-state variables the model
            reads are copied from the data: the output is data for `calibrate`.
        seed: the seed of the noise (`jax.random`); the same seed gives the
            same draws. Unused without `observe`.
        start: the first date (`YYYY-MM-DD`) of a run without dated data;
            default `2020-01-01` with `observe`, else a time axis in days.

    Returns:
        A Dataset with `state (time, state_row, patch)` (every stage of every
        compartment, with a `compartment_of_row` coordinate on `state_row`), per
        compartment totals `<name> (time, patch)`, predicted observations
        `predicted_<name>`, the observations themselves where present, each
        with `long_name` and `units`, and provenance attributes: the model and
        data files and their hashes, `parameters` and `derived_parameters` (JSON
        of the constrained values used), `parameters_source`, `params_file`
        (the `values` file, or empty), `solver`, `stepsize_controller`, `rtol`
        and `atol`; with `observe`, the noisy series, the copied inputs and
        the attributes `observation_noise` (JSON: each observation's family)
        and `observation_seed`.

    Raises:
        ValueError: a bad `observe` or `start` (a date given for dated data),
            or a family an observation cannot be drawn from (see `noise_of`).
    """
    problem = Problem(model, data, days=days, n_patches=n_patches)
    if observe is not None:
        _check_observe(problem, observe, seed)
    if start is not None or (observe is not None and problem.dates is None):
        set_dates(problem, DEFAULT_START if start is None else start)
    if params is None:
        params = load_params(problem, values)
        if values is None:
            source = "the model's initial values"
        elif isinstance(values, str | os.PathLike):
            source = f"the model's initial values, overridden from {values}"
        else:
            source = "the model's initial values, overridden by a mapping"
    elif values is not None:
        raise ValueError("Give either params (unconstrained) or values, not both.")
    else:
        source = "unconstrained params given to simulate"
    settings = SolverSettings.of(settings, rtol=rtol, atol=atol, solver=solver)
    sol, numbers, constrained = _solved(problem, params, settings)
    solved = settings.to_dict()
    attrs = {
        **parameters_json(problem.spec, constrained),
        "parameters_source": source,
        "params_file": str(values) if isinstance(values, str | os.PathLike) else "",
        **{k: solved[k] for k in _SOLVER_ATTRS},
    }
    ds = trajectory_dataset(problem, params, sol, attrs=attrs, numbers=numbers)
    if observe is not None:
        ds = add_observations(ds, problem, params, observe, seed)
    return ds


def _solved(problem: Problem, params, settings: SolverSettings):
    """`(solution, numbers, values)` at `params`: the solve (its `ys` and
    `stats`), `trajectory_numbers` along it and the constrained values, as
    NumPy from one compiled program, kept across CLI runs with the same
    inputs (`epifit._stored`). Run eagerly, each JAX operation of the solve's
    set-up and of the numbers was a small program of its own, compiled on
    first use: 56 compiles, 2.6 s of XLA in a 4.2 s call, for the 20-patch
    counts model (now one compile, 0.9 s, in a 1.9 s call). A failed solve
    raises its `SolverError`."""
    model = problem.model
    neural = [n.name for n in problem.spec.neural]
    arrays, static = eqx.partition(params, eqx.is_array)

    def simulation(arrays, data):
        p = eqx.combine(arrays, static)
        sol = problem.solve(p, settings, arrays=data, throw=False)
        values = model.constrain(p)
        return {
            "ys": sol.ys,
            "stats": sol.stats,
            "result": sol.result,
            "numbers": trajectory_numbers(problem, p, sol.ys, data),
            # neural sub-models pass through `constrain`: taken from `params`
            "values": {k: v for k, v in values.items() if k not in neural},
        }

    program = stored("simulation", simulation, out_tree=None, once=problem.compile_once)
    out = jax.tree.map(np.asarray, program(arrays, problem.arrays))
    if int(out["result"]) != 0:
        problem.solve(params, settings)  # raises the solve's own SolverError
        raise AssertionError("a failed solve did not fail again")  # pragma: no cover
    values = {**out["values"], **{n: params[n] for n in neural}}
    return SimpleNamespace(ys=out["ys"], stats=out["stats"]), out["numbers"], values


def _check_observe(problem: Problem, observe: str, seed) -> None:
    """Check, before the solve, the seed and that every observation can be
    drawn from `observe` (at the model's initial values: the check reads
    which parameters exist, not their values)."""
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise ValueError(f"--seed must be an integer >= 0; got {seed!r}")
    if not problem.spec.observations:
        raise ValueError(
            f"model '{problem.spec.name}' declares no [[observations]]: "
            "--observe has nothing to draw"
        )
    values = problem.model.constrain(problem.init_params())
    for obs in problem.spec.observations:
        noise_of(obs, values, observe)


def _state_units(problem: Problem) -> tuple[str, str]:
    """`units` of the state and where they come from: the data's initial-state
    variables when they set the whole initial state and agree on their units,
    else dimensionless (the model file declares no units)."""
    names = [i.data for i in problem.spec.initial]
    if problem.dataset is not None and names and None not in names:
        found = {problem.dataset[n].attrs.get("units") for n in names}
        if len(found) == 1 and None not in found:
            return found.pop(), f"as the data's initial state ({', '.join(names)})"
    return "1", _DIMENSIONLESS


def _data_units(problem: Problem, name: str, default: tuple[str, str]):
    """`units` of data variable `name` and where they come from, or `default`."""
    if problem.dataset is not None and name in problem.dataset:
        units = problem.dataset[name].attrs.get("units")
        if units is not None:
            return str(units), f"as the data variable '{name}'"
    return default


def _on_days(values: np.ndarray, days: np.ndarray, n_days: int) -> np.ndarray:
    """`(stamp, patch)` values placed on the daily axis, NaN on other days."""
    out = np.full((n_days, values.shape[1]), np.nan)
    out[days] = values
    return out


def _period_text(period: int) -> str:
    if period == 1:
        return ""
    return f" (the sum over the {period} days ending on each date)"


def trajectory_dataset(
    problem: Problem, params, sol, *, attrs=None, numbers=None
) -> xr.Dataset:
    """The trajectory of a solve as a Dataset: states, compartment totals,
    predicted and observed series, the reproduction number and the derived
    series, with provenance attributes (`simulate` says which).

    `numbers`: `trajectory_numbers(problem, params, sol.ys)` already computed
    (as NumPy, e.g. by a fit's compiled output program); without it they are
    computed here. `sol` needs `ys` and `stats` only."""
    model = problem.model
    if numbers is None:
        numbers = trajectory_numbers(problem, params, sol.ys)
    ys = {k: np.asarray(v) for k, v in sol.ys.items()}
    rows, comp_of_row = [], []
    blocks = []
    for name in model.compartments:
        k = model.stages[name]
        blocks.append(ys[name])
        rows += [name] if k == 1 else [f"{name}{j + 1}" for j in range(k)]
        comp_of_row += [name] * k
    state = np.concatenate(blocks, axis=1)
    if problem.dates is not None:  # CF time units are set when written
        time = (TIME, problem.dates, {"long_name": "date"})
    else:
        time = (TIME, problem.ts, {"long_name": "day", "units": "days"})
    units, units_from = _state_units(problem)
    coords = {
        TIME: time,
        "state_row": rows,
        PATCH: list(problem.patches),
        "compartment_of_row": ("state_row", comp_of_row),
    }
    strata = problem.spec.strata
    if strata is not None:
        coords[strata.name] = list(strata.labels)
    each = {o.name: o.strata != "sum" for o in problem.spec.observations}
    data_vars = {
        "state": (
            (TIME, "state_row", *cells(problem)),
            on_cells(problem, state),
            {
                "long_name": "state of every stage of every compartment",
                "units": units,
                "units_comment": units_from,
            },
        )
    }
    for name in model.compartments:
        data_vars[name] = (
            (TIME, *cells(problem)),
            on_cells(problem, ys[name].sum(axis=1)),
            {
                "long_name": f"compartment {name}, all stages",
                "units": units,
                "units_comment": units_from,
            },
        )
    n_t = problem.ts.size
    predicted = numbers["predicted"]
    for name in in_order(predicted, each):
        series = predicted[name]
        obs_units, obs_from = _data_units(problem, name, (units, units_from))
        data_vars[f"predicted_{name}"] = (
            (TIME, *cells(problem, each[name])),
            on_cells(
                problem,
                _on_days(np.asarray(series), problem.stamps[name].days, n_t),
                each[name],
            ),
            {
                "long_name": f"model prediction of '{name}'"
                + _period_text(problem.stamps[name].period),
                "units": obs_units,
                "units_comment": obs_from,
            },
        )
    if problem.dataset is not None:
        for name, obs in problem.observed.items():
            o = np.where(np.asarray(problem.mask[name]), np.asarray(obs), np.nan)
            obs_units, obs_from = _data_units(problem, name, _UNDECLARED)
            long_name = problem.dataset[name].attrs.get("long_name", name)
            data_vars[f"observed_{name}"] = (
                (TIME, *cells(problem, each[name])),
                on_cells(
                    problem, _on_days(o, problem.stamps[name].days, n_t), each[name]
                ),
                {
                    "long_name": f"observed: {long_name}",
                    "units": obs_units,
                    "units_comment": obs_from,
                },
            )
    data_vars.update(reproduction_vars(problem, numbers.get("reproduction")))
    data_vars.update(series_vars(problem, numbers["series"]))
    base = _file_attrs(problem, sol)
    return xr.Dataset(data_vars, coords=coords, attrs={**base, **(attrs or {})})


def _file_attrs(problem: Problem, sol) -> dict[str, Any]:
    """A trajectory file's attributes: provenance, units, the derived series
    (`derived_series`, JSON: the variables `epifit plot` draws beside
    `R_eff`) and the solver's counts."""
    stats = {k: int(np.asarray(v)) for k, v in sol.stats.items()}
    return {
        "title": f"epifit simulation of model '{problem.spec.name}'",
        "model": problem.spec.name,
        "model_file": str(problem.model_path or ""),
        "model_file_absolute": _absolute(problem.model_path),
        "model_text": model_text(problem.model_path),
        "data_file": str(problem.data_path or ""),
        "data_file_absolute": _absolute(problem.data_path),
        "epifit_version": epifit_version(),
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "time_units": "days since the first date",
        "units": "as the initial state (counts or fractions of each patch)",
        "derived_series": json.dumps([d.name for d in problem.spec.series]),
        **{f"solver_{k}": v for k, v in stats.items()},
        **{k: v for k, v in problem.hashes().items() if v is not None},
    }
