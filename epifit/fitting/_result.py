"""`FitResult`: a calibrated model in Python and as `FIT.nc` on disk."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import importlib.metadata
import json
import math
import os
import platform
from pathlib import Path
from typing import Any

import equinox as eqx
import numpy as np
import xarray as xr
from jax.flatten_util import ravel_pytree

from epifit.data import PATCH, TIME, DataError, open_dataset, write_dataset
from epifit.simulation import Problem

__all__ = ["FitResult", "library_versions"]

KIND = "fit"
_TABLE_VARS = ("estimate", "se", "lower", "upper")


def library_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for lib in ("epifit", "jax", "jaxlib", "equinox", "optax", "numpy", "xarray"):
        try:
            out[lib] = importlib.metadata.version(lib)
        except importlib.metadata.PackageNotFoundError:  # pragma: no cover
            out[lib] = "unknown"
    return out


@dataclasses.dataclass
class FitResult:
    """The result of [`calibrate`][epifit.calibrate].

    Attributes:
        params: the fitted parameter pytree (unconstrained coordinates), ready
            for `problem.solve`, `simulate` or a forecast.
        values: constrained parameter values and derived quantities (NumPy),
            without neural sub-models.
        table: one row per parameter value (per-patch ones per patch) and
            derived quantity: `label, name, patch, kind` (`free`, `fixed`,
            `derived`), `estimate, se, lower, upper` (the interval at `level`).
        loss: the final loss.
        iterations: iterations over all phases.
        converged: the last phase stopped on a tolerance (gradient or loss
            change), not on the iteration cap, the time budget or failures.
        message: why the fit stopped.
        loss_history, grad_norm_history, step_history: per iteration, for the
            best start; `phase_history` gives each iteration's phase (0-based).
        labels, x, covariance: the free unconstrained vector, its labels and
            its Laplace covariance (None without uncertainty).
        coefficients, coefficient_labels, coefficient_free: every array
            element of `params` (free or fixed), to rebuild `params` later.
        start_losses, initial_losses, best_start: multi-start bookkeeping.
        uncertainty: `method`, `level`, `noise_variance`, `message`.
        settings: the resolved settings of the fit (phases, tolerances,
            adjoint, seeds, ...).
        solver_stats: step counts of the final solve.
        timing: `wall_s` (the whole call) and `optimize_s`.
        trajectories: the fitted trajectories and observations (an
            `xarray.Dataset` from `trajectory_dataset`).
        problem: the problem fitted (None when read back without data).
        model_text, fit_config, hashes, versions: provenance.
    """

    params: Any
    values: dict[str, np.ndarray]
    table: list[dict]
    loss: float
    iterations: int
    converged: bool
    message: str
    loss_history: np.ndarray
    grad_norm_history: np.ndarray
    step_history: np.ndarray
    phase_history: np.ndarray
    labels: tuple[str, ...]
    x: np.ndarray
    covariance: np.ndarray | None
    coefficients: np.ndarray
    coefficient_labels: tuple[str, ...]
    coefficient_free: np.ndarray
    start_losses: np.ndarray
    initial_losses: np.ndarray
    best_start: int
    uncertainty: dict
    settings: dict
    solver_stats: dict
    timing: dict
    trajectories: xr.Dataset | None
    problem: Problem | None
    model_text: str
    fit_config: dict
    hashes: dict
    versions: dict

    # -- views ----------------------------------------------------------------------
    @property
    def parameters(self) -> dict[str, Any]:
        """Name -> constrained value (float, or a list for per-patch values),
        including derived quantities."""
        return {k: _plain(v) for k, v in self.values.items()}

    @property
    def intervals(self) -> dict[str, dict[str, float]]:
        """Label -> `{estimate, se, lower, upper}`."""
        return {r["label"]: {k: r[k] for k in _TABLE_VARS} for r in self.table}

    @property
    def model(self):
        return None if self.problem is None else self.problem.model

    def summary(self) -> str:
        """A short text report: status, loss, and the parameter table."""
        level = self.uncertainty.get("level", 0.95)
        starts = ""
        if len(self.start_losses) > 1:
            redrawn = sum(1 for r in self.settings.get("start_redraws", []) if r)
            again = f", {redrawn} drawn again for a finite loss" if redrawn else ""
            starts = f" (best of {len(self.start_losses)} starts{again})"
        lines = [
            f"{'converged' if self.converged else 'NOT converged'}: {self.message}",
            f"loss {self.loss:.10g} after {self.iterations} iterations{starts}",
        ]
        head = (
            f"{'parameter':24s} {'estimate':>13s} {'se':>11s} "
            f"{f'{100 * level:g}% interval':>27s}"
        )
        lines += [head, "-" * len(head)]
        for r in self.table:
            if r["kind"] == "fixed":
                lines.append(f"{r['label']:24s} {r['estimate']:13.6g}   (fixed)")
                continue
            if not math.isfinite(r["se"]) and not math.isfinite(r["lower"]):
                lines.append(f"{r['label']:24s} {r['estimate']:13.6g}")
                continue
            lines.append(
                f"{r['label']:24s} {r['estimate']:13.6g} {r['se']:11.4g} "
                f"[{r['lower']:12.6g}, {r['upper']:12.6g}]"
            )
        if msg := self.uncertainty.get("message"):
            lines.append(f"note: {msg}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready summary: `parameters` (name -> constrained value,
        per-patch ones as lists), `intervals`, `loss`, `iterations`,
        `converged`, `message`, ..."""
        return {
            "parameters": self.parameters,
            "intervals": {
                k: {kk: _finite_or_none(vv) for kk, vv in v.items()}
                for k, v in self.intervals.items()
            },
            "loss": float(self.loss),
            "iterations": int(self.iterations),
            "converged": bool(self.converged),
            "message": self.message,
            "n_starts": int(len(self.start_losses)),
            "best_start": int(self.best_start),
            "start_losses": [_finite_or_none(v) for v in self.start_losses],
            "uncertainty": {
                k: _finite_or_none(v) if isinstance(v, float) else v
                for k, v in self.uncertainty.items()
            },
            "timing": self.timing,
        }

    # -- netCDF -----------------------------------------------------------------------
    def to_dataset(self) -> xr.Dataset:
        """`FIT.nc` as a Dataset: the fitted trajectories, observations,
        residuals, histories, the parameter table, the full unconstrained
        coefficient vector with the covariance of its free part, and provenance
        attributes (`epifit_kind = "fit"`)."""
        if self.trajectories is None:
            raise ValueError("This FitResult has no trajectories to write.")
        ds = self.trajectories.copy()
        for name in list(ds.data_vars):
            if name.startswith("observed_"):
                obs = name[len("observed_") :]
                if f"predicted_{obs}" in ds:
                    ds[f"residual_{obs}"] = ds[name] - ds[f"predicted_{obs}"]
                    ds[f"residual_{obs}"].attrs["long_name"] = (
                        f"observed minus predicted '{obs}'"
                    )
        n_it = len(self.loss_history)
        it = np.arange(1, n_it + 1)
        ds = ds.assign_coords(iteration=("iteration", it))
        ds["loss_history"] = ("iteration", np.asarray(self.loss_history, float))
        ds["grad_norm_history"] = (
            "iteration",
            np.asarray(self.grad_norm_history, float),
            {"long_name": "max |gradient| (unconstrained coordinates)"},
        )
        ds["step_history"] = ("iteration", np.asarray(self.step_history, float))
        ds["phase_history"] = ("iteration", np.asarray(self.phase_history, np.int32))
        rows = self.table
        ds = ds.assign_coords(
            parameter=("parameter", [r["label"] for r in rows]),
            parameter_name=("parameter", [r["name"] for r in rows]),
            parameter_patch=("parameter", [r["patch"] for r in rows]),
            parameter_kind=("parameter", [r["kind"] for r in rows]),
        )
        for k in _TABLE_VARS:
            ds[k] = ("parameter", np.asarray([r[k] for r in rows], float))
        level = self.uncertainty.get("level", 0.95)
        ds["lower"].attrs["long_name"] = f"lower end of the {100 * level:g}% interval"
        ds["upper"].attrs["long_name"] = f"upper end of the {100 * level:g}% interval"
        ds["se"].attrs["long_name"] = "standard error (delta method)"
        ds = ds.assign_coords(
            coefficient=("coefficient", list(self.coefficient_labels)),
            free=("free", list(self.labels)),
            free_to=("free_to", list(self.labels)),
        )
        ds["coefficients"] = (
            "coefficient",
            np.asarray(self.coefficients, float),
            {"long_name": "every parameter array element, unconstrained"},
        )
        ds["coefficient_free"] = (
            "coefficient",
            np.asarray(self.coefficient_free, np.int8),
        )
        ds["x"] = ("free", np.asarray(self.x, float))
        cov = (
            np.full((len(self.labels),) * 2, np.nan)
            if self.covariance is None
            else np.asarray(self.covariance, float)
        )
        ds["covariance"] = (
            ("free", "free_to"),
            cov,
            {"long_name": "Laplace covariance of the free unconstrained vector"},
        )
        ds = ds.assign_coords(start=("start", np.arange(len(self.start_losses))))
        ds["start_loss"] = ("start", np.asarray(self.start_losses, float))
        ds["start_initial_loss"] = ("start", np.asarray(self.initial_losses, float))
        attrs = dict(ds.attrs)
        attrs.update(
            title=f"epifit fit of model '{attrs.get('model', '')}'",
            epifit_kind=KIND,
            loss=float(self.loss),
            iterations=int(self.iterations),
            converged=int(bool(self.converged)),
            message=self.message,
            best_start=int(self.best_start),
            model_text=self.model_text,
            fit_config=json.dumps(self.fit_config, default=_json_default),
            settings=json.dumps(self.settings, default=_json_default),
            uncertainty=json.dumps(self.uncertainty, default=_json_default),
            timing=json.dumps(self.timing),
            created=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            **{f"solver_{k}": int(v) for k, v in self.solver_stats.items()},
            **{k: v for k, v in self.hashes.items() if v},
            **{f"version_{k}": v for k, v in self.versions.items()},
        )
        for k in ("seed", "n_starts", "perturbation"):
            if self.settings.get(k) is not None:
                attrs[k] = self.settings[k]
        ds.attrs = attrs
        return ds

    def to_netcdf(self, path: str | os.PathLike) -> Path:
        """Write `FIT.nc` atomically (see `to_dataset`)."""
        return write_dataset(self.to_dataset(), path)

    @classmethod
    def from_netcdf(
        cls,
        path: str | os.PathLike,
        *,
        model=None,
        data: xr.Dataset | str | os.PathLike | None = None,
    ) -> FitResult:
        """Read a `FIT.nc` back.

        The model is rebuilt from the model text stored in the file (or given
        as `model=`), with the fit configuration's parameter overrides, and the
        fitted `params` pytree from the stored coefficients. The problem is
        bound to `data` when given, else to the original data file when it
        still exists with the same SHA-256; otherwise `problem` is None (the
        stored trajectories and observations are still available).
        """
        from epifit._paths import file_sha256
        from epifit.fitting._config import parse_fit_config
        from epifit.fitting._parameters import override_spec
        from epifit.model import compile_model, loads_model

        ds = open_dataset(path)
        kind = ds.attrs.get("epifit_kind")
        if kind != KIND:
            raise DataError(
                f"'{path}' is not an epifit fit file (epifit_kind = {kind!r}); "
                "write one with `epifit calibrate` or FitResult.to_netcdf."
            )
        fit_config = json.loads(ds.attrs.get("fit_config", "{}"))
        if model is None:
            text = ds.attrs.get("model_text", "")
            if not text:
                raise DataError(
                    f"'{path}' stores no model text (the model was built in Python);"
                    " pass model= to from_netcdf."
                )
            spec = loads_model(text, path=ds.attrs.get("model_file") or str(path))
        else:
            from epifit.model import as_model

            spec = as_model(model).spec
        n_patches = int(ds.sizes[PATCH])
        spec = override_spec(spec, parse_fit_config(fit_config), n_patches)
        compiled = compile_model(spec)
        template = compiled.init_params(n_patches)
        arrays, static = eqx.partition(template, eqx.is_inexact_array)
        flat, unravel = ravel_pytree(arrays)
        coefficients = np.asarray(ds["coefficients"].values, np.float64)
        if coefficients.size != flat.size:
            raise DataError(
                f"'{path}' holds {coefficients.size} coefficients; model "
                f"'{spec.name}' with {n_patches} patches has {flat.size}."
            )
        params = eqx.combine(unravel(np.asarray(coefficients, flat.dtype)), static)
        problem = None
        data_file = ds.attrs.get("data_file")
        if data is None and data_file and Path(data_file).exists():
            if file_sha256(data_file) == ds.attrs.get("data_sha256"):
                data = data_file
        if data is not None:
            problem = Problem(compiled, data)
            if isinstance(data, str | os.PathLike):
                problem.data_path = str(data)
        values = compiled.constrain(params)
        neural = {n.name for n in spec.neural}
        values = {k: np.asarray(v) for k, v in values.items() if k not in neural}
        table = [
            dict(
                label=str(lab),
                name=str(ds["parameter_name"].values[i]),
                patch=str(ds["parameter_patch"].values[i]),
                kind=str(ds["parameter_kind"].values[i]),
                **{k: float(ds[k].values[i]) for k in _TABLE_VARS},
            )
            for i, lab in enumerate(ds["parameter"].values)
        ]
        cov = np.asarray(ds["covariance"].values, np.float64)
        if cov.size and np.all(np.isnan(cov)):
            cov = None
        traj_vars = [
            v for v in ds.data_vars if set(ds[v].dims) <= {TIME, PATCH, "state_row"}
        ]
        trajectories = ds[traj_vars]
        a = ds.attrs
        return cls(
            params=params,
            values=values,
            table=table,
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
            coefficients=coefficients,
            coefficient_labels=tuple(str(v) for v in ds["coefficient"].values),
            coefficient_free=np.asarray(ds["coefficient_free"].values, bool),
            start_losses=np.asarray(ds["start_loss"].values),
            initial_losses=np.asarray(ds["start_initial_loss"].values),
            best_start=int(a.get("best_start", 0)),
            uncertainty=json.loads(a.get("uncertainty", "{}")),
            settings=json.loads(a.get("settings", "{}")),
            solver_stats={
                k[len("solver_") :]: int(v)
                for k, v in a.items()
                if k.startswith("solver_")
            },
            timing=json.loads(a.get("timing", "{}")),
            trajectories=trajectories,
            problem=problem,
            model_text=str(a.get("model_text", "")),
            fit_config=fit_config,
            hashes={k: a[k] for k in ("model_sha256", "data_sha256") if k in a},
            versions={
                k[len("version_") :]: v
                for k, v in a.items()
                if k.startswith("version_")
            },
        )


def _plain(v: Any) -> Any:
    a = np.asarray(v)
    if a.ndim == 0:
        return float(a)
    return [float(x) for x in a.ravel()]


def _finite_or_none(v: Any) -> Any:
    if isinstance(v, float | np.floating) and not math.isfinite(v):
        return None
    return float(v) if isinstance(v, np.floating) else v


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, tuple):
        return list(obj)
    return str(obj)
