"""`FIT.nc`: a `FitResult` as an xarray Dataset, written and read back.

The file holds the fitted trajectories and observations, residuals, the
optimiser's histories, the parameter table, every unconstrained coefficient
with the covariance of the free ones, and provenance attributes
(`epifit_kind = "fit"`): enough to rebuild the fitted model and its parameters
without the original files.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np
import xarray as xr

from epifit._flat import ravel
from epifit._paths import file_sha256
from epifit.data import PATCH, TIME, DataError, open_dataset
from epifit.fitting._config import parse_fit_config
from epifit.fitting._overrides import override_spec
from epifit.fitting._priors import check_prior_records
from epifit.fitting._result_read import (
    TABLE_VARS,
    damaged,
    json_attr,
    prefixed,
    stored_table,
)
from epifit.model import as_model, compile_model, loads_model
from epifit.simulation import Problem

__all__ = ["KIND", "TABLE_VARS", "fit_dataset", "fit_fields", "read_fit"]

KIND = "fit"


# ------------------------------------------------------------------ writing
def fit_dataset(fit: Any) -> xr.Dataset:
    """`FIT.nc` as a Dataset (see `FitResult.to_dataset`); `fit` is a
    `FitResult`."""
    if fit.trajectories is None:
        raise ValueError("This FitResult has no trajectories to write.")
    ds = _with_residuals(fit.trajectories.copy())
    ds = _with_histories(ds, fit)
    ds = _with_table(ds, fit.table, fit.uncertainty.get("level", 0.95))
    ds = _with_coefficients(ds, fit)
    ds = _with_daily(ds, fit)
    ds.attrs = _attributes(fit, dict(ds.attrs))
    return ds


def _with_residuals(ds: xr.Dataset) -> xr.Dataset:
    for name in list(ds.data_vars):
        if name.startswith("observed_"):
            obs = name[len("observed_") :]
            if f"predicted_{obs}" in ds:
                ds[f"residual_{obs}"] = ds[name] - ds[f"predicted_{obs}"]
                ds[f"residual_{obs}"].attrs["long_name"] = (
                    f"observed minus predicted '{obs}'"
                )
    return ds


def _with_histories(ds: xr.Dataset, fit: Any) -> xr.Dataset:
    n_it = len(fit.loss_history)
    it = np.arange(1, n_it + 1)
    ds = ds.assign_coords(iteration=("iteration", it))
    ds["loss_history"] = ("iteration", np.asarray(fit.loss_history, float))
    ds["grad_norm_history"] = (
        "iteration",
        np.asarray(fit.grad_norm_history, float),
        {"long_name": "max |gradient| (unconstrained coordinates)"},
    )
    ds["step_history"] = ("iteration", np.asarray(fit.step_history, float))
    ds["phase_history"] = ("iteration", np.asarray(fit.phase_history, np.int32))
    return ds


def _with_table(ds: xr.Dataset, rows: list[dict], level: float) -> xr.Dataset:
    ds = ds.assign_coords(
        parameter=("parameter", [r["label"] for r in rows]),
        parameter_name=("parameter", [r["name"] for r in rows]),
        parameter_patch=("parameter", [r["patch"] for r in rows]),
        parameter_kind=("parameter", [r["kind"] for r in rows]),
    )
    for k in TABLE_VARS:
        ds[k] = ("parameter", np.asarray([r[k] for r in rows], float))
    ds["lower"].attrs["long_name"] = f"lower end of the {100 * level:g}% interval"
    ds["upper"].attrs["long_name"] = f"upper end of the {100 * level:g}% interval"
    ds["se"].attrs["long_name"] = "standard error (delta method)"
    return ds


def _with_coefficients(ds: xr.Dataset, fit: Any) -> xr.Dataset:
    ds = ds.assign_coords(
        coefficient=("coefficient", list(fit.coefficient_labels)),
        free=("free", list(fit.labels)),
        free_to=("free_to", list(fit.labels)),
    )
    ds["coefficients"] = (
        "coefficient",
        np.asarray(fit.coefficients, float),
        {"long_name": "every parameter array element, unconstrained"},
    )
    ds["coefficient_free"] = (
        "coefficient",
        np.asarray(fit.coefficient_free, np.int8),
    )
    ds["x"] = ("free", np.asarray(fit.x, float))
    cov = (
        np.full((len(fit.labels),) * 2, np.nan)
        if fit.covariance is None
        else np.asarray(fit.covariance, float)
    )
    ds["covariance"] = (
        ("free", "free_to"),
        cov,
        {"long_name": "Laplace covariance of the free unconstrained vector"},
    )
    ds = ds.assign_coords(start=("start", np.arange(len(fit.start_losses))))
    ds["start_loss"] = ("start", np.asarray(fit.start_losses, float))
    ds["start_initial_loss"] = ("start", np.asarray(fit.initial_losses, float))
    return ds


def _with_daily(ds: xr.Dataset, fit: Any) -> xr.Dataset:
    """`NAME_daily (time[, patch])`: the fitted value of each time-varying
    parameter on every day (kept as read when the fit has no problem)."""
    model = None if fit.problem is None else fit.problem.model
    if model is None or not model.time_varying_parameters:
        return ds
    daily = model.daily_values(fit.params, ds.sizes[TIME])
    for name, v in daily.items():
        dims = (TIME, PATCH) if np.ndim(v) == 2 else (TIME,)
        ds[f"{name}_daily"] = (
            dims,
            np.asarray(v, float),
            {"long_name": f"fitted daily value of time-varying parameter '{name}'"},
        )
    return ds


def _attributes(fit: Any, attrs: dict) -> dict:
    attrs.update(
        title=f"epifit fit of model '{attrs.get('model', '')}'",
        epifit_kind=KIND,
        loss=float(fit.loss),
        iterations=int(fit.iterations),
        converged=int(bool(fit.converged)),
        message=fit.message,
        best_start=int(fit.best_start),
        model_text=fit.model_text,
        fit_config=json.dumps(fit.fit_config, default=_json_default),
        settings=json.dumps(fit.settings, default=_json_default),
        uncertainty=json.dumps(fit.uncertainty, default=_json_default),
        timing=json.dumps(fit.timing),
        created=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        **{f"solver_{k}": int(v) for k, v in fit.solver_stats.items()},
        **{k: v for k, v in fit.hashes.items() if v},
        **{f"version_{k}": v for k, v in fit.versions.items()},
    )
    for k in ("seed", "n_starts", "perturbation"):
        if fit.settings.get(k) is not None:
            attrs[k] = fit.settings[k]
    attrs.update(_information_attributes(fit))
    return attrs


# the log-likelihood and information criteria (attributes; absent from files
# written before them, read back as NaN and None)
INFORMATION_FLOATS = ("log_likelihood", "aic", "bic")
INFORMATION_COUNTS = ("n_parameters", "n_data")


def _information_attributes(fit: Any) -> dict:
    attrs = {k: float(getattr(fit, k)) for k in INFORMATION_FLOATS}
    attrs.update(
        {
            k: int(getattr(fit, k))
            for k in INFORMATION_COUNTS
            if getattr(fit, k) is not None
        }
    )
    attrs["notes"] = json.dumps(list(fit.notes))
    attrs["priors"] = json.dumps(fit.priors)
    return attrs


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, tuple):
        return list(obj)
    return str(obj)


# ------------------------------------------------------------------ reading
def read_fit(
    path: str | os.PathLike,
    *,
    model=None,
    data: xr.Dataset | str | os.PathLike | None = None,
    group: str | None = None,
) -> dict[str, Any]:
    """The fields of the `FitResult` stored in a `FIT.nc`, or in the netCDF
    group `group` of another file (the `fit` group of a `POSTERIOR.nc`; see
    `FitResult.from_netcdf`)."""
    ds = open_dataset(path, group=group)
    where = f"'{path}'" if group is None else f"'{path}' (group '{group}')"
    folder = Path(path).resolve().parent
    return fit_fields(ds, where, model=model, data=data, folder=folder, name=str(path))


def fit_fields(
    ds: xr.Dataset,
    where: str,
    *,
    model=None,
    data: xr.Dataset | str | os.PathLike | None = None,
    folder: Path | None = None,
    name: str = "",
) -> dict[str, Any]:
    """The fields of the `FitResult` a `FIT.nc` dataset holds (see
    `FitResult.from_dataset`); `where` names it in messages, `folder` is where
    a data file named by a relative path is looked for first (before the
    working directory), `name` the model's source for its parse errors."""
    kind = ds.attrs.get("epifit_kind")
    if kind != KIND:
        raise DataError(
            f"{where} is not an epifit fit file (epifit_kind = {kind!r}); "
            "write one with `epifit calibrate` or FitResult.to_netcdf."
        )
    _check_stored(ds, where)
    fit_config = json_attr(ds, where, "fit_config")
    spec = _stored_spec(ds, where, model, name)
    n_patches = int(ds.sizes[PATCH])
    spec = override_spec(spec, parse_fit_config(fit_config), n_patches)
    # time-varying parameters span the fitted days (the trajectories' days);
    # per-stratum parameters reach the cells of the fitted patches
    compiled = compile_model(spec).bind_patches(n_patches)
    compiled = compiled.bind_days(int(ds.sizes.get(TIME, 1)))
    params, coefficients = _stored_params(ds, where, compiled, n_patches)
    values = compiled.constrain(params)
    neural = {n.name for n in spec.neural}
    values = {k: np.asarray(v) for k, v in values.items() if k not in neural}
    return dict(
        params=params,
        values=values,
        table=stored_table(ds),
        coefficients=coefficients,
        problem=_stored_problem(ds, compiled, data, folder),
        fit_config=fit_config,
        **_stored_fields(ds, where),
    )


# the variables (and coordinates) every FIT.nc holds, and its attributes
REQUIRED_VARS = (
    "coefficients",
    "coefficient_free",
    "x",
    "covariance",
    "loss_history",
    "grad_norm_history",
    "step_history",
    "phase_history",
    "start_loss",
    "start_initial_loss",
    *TABLE_VARS,
    "parameter_name",
    "parameter_patch",
    "parameter_kind",
)
REQUIRED_ATTRS = ("loss", "iterations", "converged")


def _check_stored(ds: xr.Dataset, where) -> None:
    """Every variable and attribute a fit file holds, of consistent shapes and
    counts, and the stored model text the one its `model_sha256` names."""
    missing = [v for v in REQUIRED_VARS if v not in ds.variables]
    if missing:
        raise damaged(where, f"no variable {', '.join(map(repr, missing))}")
    missing = [a for a in REQUIRED_ATTRS if a not in ds.attrs]
    if missing:
        raise damaged(where, f"no attribute {', '.join(map(repr, missing))}")
    if PATCH not in ds.sizes:
        raise damaged(where, "no 'patch' dimension")
    try:
        float(ds.attrs["loss"])
        iterations = int(ds.attrs["iterations"])
        int(ds.attrs["converged"])
        int(ds.attrs.get("best_start", 0))
    except (TypeError, ValueError) as e:
        raise damaged(where, f"an attribute is not a number ({e})") from None
    _check_information(ds, where)
    if iterations < 0 or iterations != ds.attrs["iterations"]:
        raise damaged(where, f"'iterations' = {ds.attrs['iterations']}")
    if iterations < ds["loss_history"].size:
        raise damaged(
            where,
            f"{ds['loss_history'].size} iterations of history for 'iterations' = "
            f"{iterations}",
        )
    if not 0 <= int(ds.attrs.get("best_start", 0)) < max(ds["start_loss"].size, 1):
        raise damaged(where, f"'best_start' = {ds.attrs.get('best_start')}")
    n = ds["x"].size
    if ds["covariance"].shape != (n, n):
        shape = ds["covariance"].shape
        raise damaged(where, f"'covariance' has shape {shape} for {n} free values")
    if ds["coefficient_free"].shape != ds["coefficients"].shape:
        raise damaged(where, "'coefficient_free' and 'coefficients' differ in length")
    if int(np.asarray(ds["coefficient_free"].values, bool).sum()) != n:
        raise damaged(
            where, f"'coefficient_free' marks a number of free values other than {n}"
        )
    _check_model_text(ds, where)


def _check_information(ds: xr.Dataset, where) -> None:
    """The log-likelihood, AIC, BIC and counts, where the file has them: numbers
    (counts whole and >= 0)."""
    a = ds.attrs
    for k in (*INFORMATION_FLOATS, *INFORMATION_COUNTS):
        if k not in a:
            continue
        try:
            value = float(a[k])
        except (TypeError, ValueError):
            raise damaged(
                where, f"attribute '{k}' is not a number ({a[k]!r})"
            ) from None
        if k in INFORMATION_COUNTS and not (value >= 0 and value == int(value)):
            raise damaged(where, f"'{k}' = {a[k]} is not a count")


def _check_model_text(ds: xr.Dataset, where) -> None:
    """Refuse model text that is not the text whose SHA-256 the file stores
    (it was edited after the fit: the fitted coefficients belong to the
    original model)."""
    text = ds.attrs.get("model_text", "")
    sha = ds.attrs.get("model_sha256")
    if not text or not sha:
        return
    ok = {
        hashlib.sha256(t.encode("utf-8")).hexdigest()
        for t in (text, text.replace("\r\n", "\n").replace("\n", "\r\n"))
    }
    if sha not in ok:
        raise DataError(
            f"{where}: the stored model text does not match its model_sha256 "
            f"({sha[:12]}...): it was changed after the fit, and the fitted "
            "coefficients belong to the original model. Fit the changed model "
            "again (epifit calibrate), or pass the model explicitly (model=...)."
        )


def _stored_spec(ds: xr.Dataset, where, model, name: str):
    """The model spec: the model given, else the model text in the file."""
    if model is not None:
        return as_model(model).spec
    text = ds.attrs.get("model_text", "")
    if not text:
        raise DataError(
            f"{where} stores no model text (the model was built in Python);"
            " pass model= to from_netcdf."
        )
    return loads_model(text, path=ds.attrs.get("model_file") or name or "<fit>")


def _stored_params(ds: xr.Dataset, where, compiled, n_patches: int):
    """The fitted parameter pytree from the stored coefficients."""
    template = compiled.init_params(n_patches)
    arrays, static = eqx.partition(template, eqx.is_inexact_array)
    flat, unravel = ravel(arrays)  # NumPy: no program compiled
    coefficients = np.asarray(ds["coefficients"].values, np.float64)
    if coefficients.size != flat.size:
        raise DataError(
            f"{where} holds {coefficients.size} coefficients; model "
            f"'{compiled.spec.name}' with {n_patches} patches has {flat.size}."
        )
    leaves = jax.tree.map(jax.device_put, unravel(coefficients.astype(flat.dtype)))
    params = eqx.combine(leaves, static)
    return params, coefficients


def _stored_problem(ds: xr.Dataset, compiled, data, folder) -> Problem | None:
    """The problem bound to `data`, else to the original data file when it
    still exists with the same SHA-256 (its absolute path, then its path as
    given relative to `folder`, then to the working directory), else None."""
    if data is None:
        data = _stored_data_file(ds, folder)
    if data is None:
        return None
    problem = Problem(compiled, data)
    if isinstance(data, str | os.PathLike):
        problem.data_path = str(data)
    return problem


def _stored_data_file(ds: xr.Dataset, folder: Path | None) -> str | None:
    """The fitted data file, found again by its SHA-256 (None when gone): the
    path as stored when absolute; else its absolute form from the fit (when it
    ends in the same path), then the path relative to `folder` (the folder of
    the file holding the fit; None for a dataset in memory), then to the
    working directory."""
    given = str(ds.attrs.get("data_file") or "")
    sha = ds.attrs.get("data_sha256")
    if not given or not sha:
        return None
    candidates = [given]
    if not Path(given).is_absolute():
        tail = tuple(p for p in Path(given).parts if p not in (".", ".."))
        absolute = str(ds.attrs.get("data_file_absolute") or "")
        if absolute and Path(absolute).parts[-len(tail) :] == tail:
            candidates.insert(0, absolute)
        if folder is not None:
            candidates.insert(-1, str(Path(folder) / given))
    for c in candidates:
        if Path(c).is_file() and file_sha256(c) == sha:
            return c
    return None


def _stored_fields(ds: xr.Dataset, where) -> dict[str, Any]:
    """The fields stored as variables and attributes as they are."""
    cov = np.asarray(ds["covariance"].values, np.float64)
    if cov.size and np.all(np.isnan(cov)):
        cov = None
    traj_vars = [
        v for v in ds.data_vars if set(ds[v].dims) <= {TIME, PATCH, "state_row"}
    ]
    a = ds.attrs
    return dict(
        loss=float(a["loss"]),
        iterations=int(a["iterations"]),
        converged=bool(int(a["converged"])),
        message=str(a.get("message", "")),
        loss_history=np.asarray(ds["loss_history"].values),
        grad_norm_history=np.asarray(ds["grad_norm_history"].values),
        step_history=np.asarray(ds["step_history"].values),
        phase_history=np.asarray(ds["phase_history"].values),
        labels=tuple(str(v) for v in ds["free"].values),
        x=np.asarray(ds["x"].values),
        covariance=cov,
        coefficient_labels=tuple(str(v) for v in ds["coefficient"].values),
        coefficient_free=np.asarray(ds["coefficient_free"].values, bool),
        start_losses=np.asarray(ds["start_loss"].values),
        initial_losses=np.asarray(ds["start_initial_loss"].values),
        best_start=int(a.get("best_start", 0)),
        uncertainty=json_attr(ds, where, "uncertainty"),
        settings=json_attr(ds, where, "settings"),
        solver_stats=prefixed(a, "solver_", int),
        timing=json_attr(ds, where, "timing"),
        trajectories=ds[traj_vars],
        model_text=str(a.get("model_text", "")),
        hashes={k: a[k] for k in ("model_sha256", "data_sha256") if k in a},
        versions=prefixed(a, "version_", lambda v: v),
        **{k: float(a.get(k, np.nan)) for k in INFORMATION_FLOATS},
        **{k: int(a[k]) if k in a else None for k in INFORMATION_COUNTS},
        notes=_stored_notes(ds, where),
        priors=_stored_priors(ds, where),
    )


def _stored_priors(ds: xr.Dataset, where) -> dict:
    """Every free parameter's prior (none in a file written before them)."""
    if "priors" not in ds.attrs:
        return {}
    priors = json_attr(ds, where, "priors")
    names = {str(lab).split("[")[0].split(".")[0] for lab in ds["free"].values}
    if why := check_prior_records(priors, names):
        raise damaged(where, why)
    return priors


def _stored_notes(ds: xr.Dataset, where) -> list[str]:
    """The fit's notes (none in a file written before them)."""
    notes = json.loads(ds.attrs["notes"]) if "notes" in ds.attrs else []
    if not isinstance(notes, list) or not all(isinstance(n, str) for n in notes):
        raise damaged(where, "attribute 'notes' is not a JSON list of strings")
    return notes
