"""A model bound to a dataset: everything a solve, a loss or a forecast needs."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import xarray as xr

from epifit._jit import ONCE_MAX_STATES
from epifit._memory import check_memory
from epifit._paths import file_sha256
from epifit.data import (
    PATCH,
    TIME,
    DataError,
    data_period,
    open_dataset,
    validate_dataset,
)
from epifit.model import (
    ModelSpec,
    SparseCoupling,
    as_model,
    break_days,
    kron_operands,
    sparse_coupling,
)
from epifit.ode import Solution
from epifit.simulation._eager import solve_run
from epifit.simulation._run import ModelRun
from epifit.simulation._settings import SolverSettings
from epifit.simulation._stamps import (
    Stamps,
    at_stamps,
    default_stamps,
    stamps_of,
    weekday_of,
)
from epifit.simulation._strata import (
    align_strata,
    cell_covariates,
    cell_initial,
    cell_observed,
    observed_dims,
)


class Problem:
    """A compiled model bound to a dataset, as arrays ready for the solver.

    The dataset is validated against the model (covariates, observed variables,
    initial-state variables), its patches matched by label, and its time axis
    turned into days since the first date (`t = 0` on the first day). The
    covariates enter every solve as traced data, never closed over.

    Args:
        model: a TOML path, a `ModelSpec` or a `CompiledModel`.
        data: an `xarray.Dataset`, a netCDF path, or `None` (a model with no
            covariates and no observations, simulated for `days` days).
        days: the number of days to solve for (default: the data's days). Beyond
            the data, covariates carry their last day forward.
        n_patches: the number of patches when the data have no `patch` dim.
        subset_patches: keep only the model's patches when the data have more.
        dtype: `float32` or `float64` (default: JAX's default float).

    The bound model and data are its attributes `model`, `dataset`, `ts`
    (`(time,)` float days), `patches` (labels), `covariates`, `initial_data`,
    `observed`, `mask`, `n_patches` and `dates`.

    Attributes:
        breaks: the days on which the model's per-day inputs can change with
            these covariates (`epifit.model.break_days`; `None` when they may
            change every day): solves evaluate the inputs there only, and a
            solve with covariates that change elsewhere raises. Set it to
            `None` for the daily grid.
    """

    def __init__(
        self,
        model,
        data: xr.Dataset | str | os.PathLike | None = None,
        *,
        days: int | None = None,
        n_patches: int | None = None,
        subset_patches: bool = False,
        dtype=None,
    ):
        self.model = as_model(model)
        self.model_path = self.model.spec.path
        self.data_path = None
        if isinstance(data, str | os.PathLike):
            self.data_path = str(data)
            data = open_dataset(data)
        self.dtype = jnp.result_type(float) if dtype is None else jnp.dtype(dtype)
        if data is None:
            self._bind_nothing(days, n_patches)
        elif not isinstance(data, xr.Dataset):
            raise TypeError(
                f"data must be an xarray.Dataset or a path; got {type(data)}."
            )
        else:
            self._bind(data, days, n_patches, subset_patches)
        # time-varying parameters: their coefficients span the solved days
        self.model = self.model.bind_days(int(self.ts.size))
        self.breaks = break_days(self.model, self.covariates, int(self.ts.size))

    def _bind_nothing(self, days: int | None, n_patches: int | None) -> None:
        """A model with no covariates and no initial data, solved for `days`."""
        spec = self.spec
        covariates = [c.name for c in spec.covariates]
        initial_vars = _initial_variables(spec)
        if covariates or initial_vars:
            needed = sorted(covariates) + initial_vars
            raise DataError(
                f"Model '{spec.name}' needs data variables {needed}; pass a "
                "dataset (--data DATA.nc)."
            )
        if days is None:
            raise ValueError("Without data, give the number of days to solve for.")
        self.dataset = None
        self._set_patches(_default_patches(n_patches))
        check_days(self.model, self.n_cells, days)
        self.ts = np.arange(days, dtype=np.float64)
        self.dates = None
        self.covariates, self.initial_data = {}, {}
        self.observed, self.mask = {}, {}
        self.stamps = {o.name: default_stamps(o, days) for o in spec.observations}

    def _bind(self, data: xr.Dataset, days, n_patches, subset_patches) -> None:
        """Validate `data` against the model and store it as arrays: the
        patches, the time axis, covariates, initial data, observations."""
        spec = self.spec
        covariates = {c.name: c.data_dims or c.dims for c in spec.covariates}
        observations = observed_dims(spec, data)
        initial_vars = _initial_variables(spec)
        names = [*covariates, *observations, *initial_vars]
        data = align_strata(data, spec, names, self.data_path)
        self.missing_observations = [
            o.name for o in spec.observations if o.name not in data.data_vars
        ]
        bound = validate_dataset(
            data,
            observations=observations,
            covariates=covariates,
            subset_patches=subset_patches,
        )
        ds = bound.dataset
        _check_initial_variables(ds, initial_vars)
        self.dataset = ds
        self._set_patches(_patch_labels(bound, PATCH in data.dims, n_patches))
        if days is not None:
            check_days(self.model, self.n_cells, days)
        self.ts, self.dates = _time_axis(ds, bound, days)
        _check_daily_covariates(spec, bound, self.data_path)
        self.covariates = _covariate_arrays(
            cell_covariates(spec, bound.covariates, self.n_patches),
            {c.name: c.dims for c in spec.covariates},
            self.dtype,
            dense=kron_operands(spec),
        )
        self.initial_data = _initial_arrays(ds, initial_vars, self.dtype, self)
        self.stamps = _stamps(spec, ds, bound, self.ts.size, self.data_path)
        self.observed, self.mask = _observation_arrays(
            bound, observations, self.stamps, self.dtype
        )

    def _set_patches(self, patches: tuple[str, ...]) -> None:
        """The patches; with `[strata]` the model is bound to them and its
        structure axis is the `n_cells = n_patches * n_strata` cells."""
        self.patches = patches
        self.n_patches = len(patches)
        self.model = self.model.bind_patches(self.n_patches)
        self.n_cells = self.n_patches * self.model.n_strata

    @property
    def n_states(self) -> int:
        """The size of a solve's state: every compartment's stages in every
        cell."""
        return sum(self.model.stages.values()) * self.n_cells

    @property
    def compile_once(self) -> bool:
        """Whether a program evaluated once on this problem (a simulation, a
        fit's outputs) is compiled for one cheap evaluation
        (`epifit.jit(once=True)`): up to `ONCE_MAX_STATES` states."""
        return self.n_states <= ONCE_MAX_STATES

    # ------------------------------------------------------------------ solving
    @property
    def spec(self) -> ModelSpec:
        return self.model.spec

    def init_params(self, *, key=None):
        return self.model.init_params(self.n_patches, key=key)

    @property
    def arrays(self) -> dict[str, dict[str, jnp.ndarray]]:
        """The problem's data as one pytree, to pass to compiled functions as a
        traced argument (never closed over: constants would be baked into the
        executable and slow its compilation)."""
        arrays = {
            "covariates": dict(self.covariates),
            "initial": dict(self.initial_data),
            "observed": dict(self.observed),
            "mask": dict(self.mask),
        }
        if self.dates is not None:
            arrays["weekday"] = jax.device_put(weekday_of(self.dates))
        return arrays

    def solve(
        self,
        params,
        settings: SolverSettings | None = None,
        *,
        arrays: Mapping[str, Any] | None = None,
        throw: bool = True,
        **overrides,
    ) -> Solution:
        """Solve the model at `params` (unconstrained) over the problem's days.

        Args:
            params: unconstrained parameters.
            settings: the solver settings (default `SolverSettings()`).
            arrays: the problem's data (default `self.arrays`: covariates and
                initial data); pass it as a traced argument under `jit`, or
                modified for scenarios.
            throw: raise `SolverError` on a failed solve; with `False` the
                result code is in `Solution.result`.
            **overrides: fields of `SolverSettings` replacing those of
                `settings` (`rtol=1e-8`, `solver="kvaerno5"`, ...).
        """
        settings = SolverSettings.of(settings, **overrides)
        arrays = self.arrays if arrays is None else arrays
        run = ModelRun(
            self.model, self.ts, self.n_cells, self.dtype, settings, breaks=self.breaks
        )
        return solve_run(self, run, params, arrays, throw)

    def predict(self, params, ys, arrays=None) -> dict[str, jnp.ndarray]:
        """The expected value of every observation at its compared stamps
        (`self.stamps`: `(stamp, patch)`, matching `self.observed`), in the
        data's units: reported (delay, ascertainment, scale, week effect) and
        summed over each stamp's period."""
        arrays = self.arrays if arrays is None else arrays
        daily = self.daily_predictions(params, ys, arrays)
        return {k: at_stamps(v, self.stamps[k]) for k, v in daily.items()}

    def daily_predictions(self, params, ys, arrays=None) -> dict[str, jnp.ndarray]:
        """The daily expected series of every observation (see
        `CompiledModel.observe`): row `k` for day `first_day + k`."""
        arrays = self.arrays if arrays is None else arrays
        return self.model.observe(
            ys, params, arrays["covariates"], weekday=arrays.get("weekday")
        )

    def require_observations(self) -> None:
        """Check that the data hold every observation the model declares, each
        with at least one finite, unmasked value: what a fit needs (a
        simulation may still predict unobserved series).

        Raises:
            DataError: naming the missing or empty variables and listing the
                dataset's variables.
        """
        spec = self.spec
        where = f"Model '{spec.name}'" + (
            f" ({self.model_path})" if self.model_path else ""
        )
        if not spec.observations:
            raise DataError(
                f"{where} declares no [[observations]]; a fit needs at least one "
                "observed series to compare with the data."
            )
        if self.dataset is None:
            raise DataError(
                f"{where} observes {[o.name for o in spec.observations]}; a fit "
                "needs a dataset holding them (--data DATA.nc)."
            )
        found = sorted(map(str, self.dataset.data_vars))
        missing = self.missing_observations
        if missing:
            raise DataError(
                f"{where} observes {_names(missing)}, which the dataset lacks; "
                f"found {found}. Add the variable(s) to the data, or remove "
                "their [[observations]] from the model.",
                file=self.data_path,
            )
        empty = []
        for o in spec.observations:
            y = np.asarray(self.observed[o.name])
            if not (np.asarray(self.mask[o.name]) & np.isfinite(y)).any():
                empty.append(o.name)
        if empty:
            raise DataError(
                f"observed variable(s) {_names(empty)} of model '{spec.name}' "
                "hold no finite value (every point is missing or NaN): there is "
                "nothing to fit them to. Give data with observed values, or "
                "remove their [[observations]] from the model.",
                file=self.data_path,
            )

    def hashes(self) -> dict[str, str | None]:
        return {
            "model_sha256": file_sha256(self.model_path),
            "data_sha256": file_sha256(self.data_path),
        }


def _names(names: list[str]) -> str:
    return ", ".join(f"'{n}'" for n in names)


# the copies of the trajectories a simulation holds (the solver's saved
# states, their NumPy copy, the concatenated `state`, the per-compartment
# totals and predictions, the netCDF encoding): measured 170 MB above the
# process's baseline for the SIR (3 states) over 1e6 days, 7.1 copies
TRAJECTORY_COPIES = 8


def check_days(model, n_patches: int, days) -> None:
    """`days` checked to be an integer >= 1 whose trajectories fit in memory
    (see `epifit._memory.check_memory`), before anything is allocated.

    Raises:
        ValueError: not an integer >= 1.
        SizeError: the trajectories would not fit in memory; the message gives
            the estimate.
    """
    if isinstance(days, bool) or not isinstance(days, int | np.integer) or days < 1:
        raise ValueError(f"days must be an integer >= 1; got {days!r}.")
    n_states = sum(model.stages.values())
    nbytes = 8.0 * TRAJECTORY_COPIES * n_states * n_patches * int(days)
    check_memory(
        nbytes,
        f"days = {days}",
        f"the trajectories ({n_states} states x {n_patches} patches x "
        f"{int(days):.3g} days x 8 bytes x {TRAJECTORY_COPIES} copies)",
        "give fewer days (--days)",
    )


# -- binding a dataset ---------------------------------------------------------------
def _initial_variables(spec: ModelSpec) -> list[str]:
    """The data variables the model's `[initial]` table reads."""
    return [i.data for i in spec.initial if i.data is not None]


def _default_patches(n_patches: int | None) -> tuple[str, ...]:
    return tuple(f"p{i}" for i in range(n_patches or 1))


def _check_initial_variables(ds: xr.Dataset, names: list[str]) -> None:
    for name in names:
        if name not in ds.data_vars:
            raise DataError(
                f"No variable '{name}' in dataset (the model's initial state "
                f"needs it); found {sorted(map(str, ds.data_vars))}"
            )


def _patch_labels(bound, has_patch: bool, n_patches: int | None) -> tuple[str, ...]:
    """The patch labels: the model's (matched by label), the data's, or
    `p0, p1, ...` for data without a `patch` dim."""
    if bound.patches is not None:
        return bound.patches
    if has_patch:
        return tuple(str(p) for p in bound.dataset[PATCH].values)
    return _default_patches(n_patches)


def _time_axis(ds: xr.Dataset, bound, days: int | None):
    """`(ts, dates)`: days since the first date, `(time,)` float, and the
    dates when the data's time axis holds them (else `None`)."""
    n_data_days = None if bound.times is None else int(bound.times[-1]) + 1
    if n_data_days is None and TIME in ds.dims:
        # no variable the model reads has a time axis (every observed one
        # missing, say): the dataset's own time axis still counts its days
        n_data_days = int(ds.sizes[TIME])
    if days is None and n_data_days is None:
        raise DataError(
            "The dataset has no 'time' dimension; give the number of days to solve for."
        )
    n = days if days is not None else n_data_days
    ts = np.arange(n, dtype=np.float64)
    dates = None
    if TIME in ds.coords and np.issubdtype(ds[TIME].dtype, np.datetime64):
        start = ds[TIME].values[0]
        dates = start + np.arange(n).astype("timedelta64[D]")
    return ts, dates


def _covariate_arrays(values: Mapping[str, Any], dims, dt, dense=()) -> dict:
    """The covariates as arrays of `dt`; mobility matrices `(..., patch_to)`
    stored by rows when sparse (see `SparseCoupling`), except the contact
    matrices over strata of `kron(M, C)` couplings (`dense[k] == "stratum"`)."""
    covariates = {}
    for k, v in values.items():
        if dims[k][-1:] == ("patch_to",) and dense.get(k) != "stratum":
            covariates[k] = sparse_coupling(v.astype(dt))
            if not isinstance(covariates[k], SparseCoupling):
                covariates[k] = jnp.asarray(v, dt)
        else:
            covariates[k] = jnp.asarray(v, dt)
    return covariates


def _initial_arrays(ds: xr.Dataset, names: list[str], dt, problem) -> dict:
    """The initial-state variables, `(patch,)` or `(stage, patch)` (on the
    cells with `[strata]`)."""
    initial = {}
    for name in names:
        da = ds[name]
        if problem.spec.strata is not None:
            v = cell_initial(problem.spec, da, problem.n_patches)
            initial[name] = jnp.asarray(v, dt)
            continue
        dims = [d for d in da.dims if d != PATCH] + (
            [PATCH] if PATCH in da.dims else []
        )
        initial[name] = jnp.asarray(da.transpose(*dims).values, dt)
    return initial


def _observation_arrays(bound, observations, stamps, dt) -> tuple[dict, dict]:
    """`(observed, mask)`, each series `(stamp, patch)` at its compared stamps
    (a series without a `patch` dim gets one)."""
    observed, masks = {}, {}
    for name, dims in observations.items():
        rows = stamps[name].rows
        obs = bound.observed[name][rows]
        mask = bound.mask[name][rows]
        if PATCH not in dims:
            obs, mask = obs[:, None], mask[:, None]
        obs, mask = cell_observed(obs), cell_observed(mask)
        # device_put, not jnp.asarray: no program compiled for the transfer
        observed[name] = jax.device_put(np.asarray(obs, dt))
        masks[name] = jax.device_put(np.asarray(mask))
    return observed, masks


def _stamp_days(ds: xr.Dataset, bound) -> np.ndarray:
    """The day (since the first date) of each row of the data's time axis."""
    return np.rint(np.asarray(bound.times, np.float64)).astype(np.int64)


def _step(bound) -> int:
    """The time axis' step in days (1 for a single stamp or no axis)."""
    return bound.step or 1


def _stamps(spec, ds: xr.Dataset, bound, n_days: int, path) -> dict[str, Stamps]:
    """The compared stamps of each observation: the data's stamps (within the
    solved days) whose period lies within the predicted days; an
    observation's period must be the data's."""
    out = {}
    days = None if bound.times is None else _stamp_days(ds, bound)
    for o in spec.observations:
        if o.name not in bound.observed or days is None:
            out[o.name] = default_stamps(o, n_days)
            continue
        period = data_period(ds, o.name) or 1
        if period != o.period:
            raise DataError(
                f"observation '{o.name}' has period = {o.period} day(s) in the "
                f"model but the data's '{o.name}' has a period of {period} "
                "day(s); give the observation period = "
                + ('"week"' if period == 7 else str(period))
                + " or data of the model's period",
                file=path,
            )
        stamps = stamps_of(o, days)
        inside = stamps.days < n_days
        out[o.name] = Stamps(
            stamps.days[inside], stamps.rows[inside], o.period, o.first_day
        )
    return out


def _check_daily_covariates(spec, bound, path) -> None:
    """Time-varying covariates need a daily time axis."""
    step = _step(bound)
    if step == 1:
        return
    tv = [c.name for c in spec.covariates if c.time_varying]
    if tv:
        raise DataError(
            f"the data's time axis has a step of {step} days, but covariate(s) "
            f"{_names(tv)} vary in time and need a value for every day; give "
            "them on a daily time axis",
            file=path,
        )
