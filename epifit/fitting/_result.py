"""`FitResult`: a calibrated model in Python and as `FIT.nc` on disk."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import math
import os
import platform
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

from epifit.data import write_dataset
from epifit.fitting._fallback import is_fallback
from epifit.fitting._result_io import TABLE_VARS, fit_dataset, fit_fields, read_fit
from epifit.simulation import Problem

__all__ = ["FIT_GROUP", "FitResult", "library_versions"]

# the netCDF group of another file that holds a fit as `FIT.nc` does (the MAP
# fit a `POSTERIOR.nc` of `epifit sample` embeds): `FitResult.from_netcdf(path,
# group=FIT_GROUP)`
FIT_GROUP = "fit"


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
        loss: the loss at the point returned: the last iterate, or the best
            point seen when the last iterate is worse (the message says so).
        iterations: iterations over all phases.
        converged: the last phase stopped on a tolerance (gradient or loss
            change), not on the iteration cap, the time budget or failures,
            at the point returned (False when the best point seen replaced a
            worse last iterate).
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
        log_likelihood: the observations' log-likelihood at the point returned
            (unweighted; see `Objective.log_likelihood`), NaN when read from
            a `FIT.nc` written before it was stored.
        aic, bic: `2 k - 2 log_likelihood` and `k ln(n) - 2 log_likelihood`.
        n_parameters: `k`, the free scalar parameters (the length of `x`,
            neural weights included); n_data: `n`, the observed (unmasked)
            points. None when read from an older `FIT.nc`.
        notes: one-line remarks on the fit that are neither errors nor
            warnings (e.g. scalar parameters shared by several patches).
        priors: free parameter (or neural sub-model) -> its prior's record
            (`family`, its numbers, `on`, `source`; see the calibration
            reference's priors): the loss is the negative log posterior.
            Empty when read from a `FIT.nc` written before priors were stored.
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
    log_likelihood: float = math.nan
    aic: float = math.nan
    bic: float = math.nan
    n_parameters: int | None = None
    n_data: int | None = None
    notes: list[str] = dataclasses.field(default_factory=list)
    priors: dict = dataclasses.field(default_factory=dict)

    # -- views ----------------------------------------------------------------------
    @property
    def parameters(self) -> dict[str, Any]:
        """Name -> constrained value (float, or a list for per-patch values),
        including derived quantities."""
        return {k: _plain(v) for k, v in self.values.items()}

    @property
    def intervals(self) -> dict[str, dict[str, float]]:
        """Label -> `{estimate, se, lower, upper}`."""
        return {r["label"]: {k: r[k] for k in TABLE_VARS} for r in self.table}

    @property
    def laplace_fallback(self) -> bool:
        """Whether `covariance` is the fallback for a Hessian with negative
        curvature at `x` (its message says so): then it is not the inverse of
        the posterior's Hessian, and `x` may be a saddle rather than a mode."""
        return is_fallback(self.uncertainty.get("message", ""))

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
        if self.n_parameters is not None:  # None: read from an older FIT.nc
            lines.append(
                f"log-likelihood {self.log_likelihood:.10g}, AIC {self.aic:.10g}, "
                f"BIC {self.bic:.10g} ({self.n_parameters} free parameters, "
                f"{self.n_data} observed points)"
            )
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
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready summary: `parameters` (name -> constrained value,
        per-patch ones as lists), `intervals`, `loss`, `log_likelihood`,
        `aic`, `bic`, `n_parameters`, `n_data`, `notes`, `iterations`,
        `converged`, `message`, ... (non-finite numbers as null)."""
        return {
            "parameters": self.parameters,
            "intervals": {
                k: {kk: _finite_or_none(vv) for kk, vv in v.items()}
                for k, v in self.intervals.items()
            },
            "loss": float(self.loss),
            "log_likelihood": _finite_or_none(float(self.log_likelihood)),
            "aic": _finite_or_none(float(self.aic)),
            "bic": _finite_or_none(float(self.bic)),
            "n_parameters": self.n_parameters,
            "n_data": self.n_data,
            "notes": list(self.notes),
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
        return fit_dataset(self)

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
        group: str | None = None,
    ) -> FitResult:
        """Read a `FIT.nc` back.

        The model is rebuilt from the model text stored in the file (or given
        as `model=`), with the fit configuration's parameter overrides, and the
        fitted `params` pytree from the stored coefficients. The problem is
        bound to `data` when given, else to the original data file when it
        still exists with the same SHA-256 (its absolute path, then its path
        as stored relative to this file's folder, then to the working
        directory); otherwise `problem` is None (the stored trajectories and
        observations are still available). `group` reads the fit from a
        netCDF group of another file: `group="fit"` the fit a `POSTERIOR.nc`
        of [`sample`][epifit.sample] embeds.
        """
        return cls(**read_fit(path, model=model, data=data, group=group))

    @classmethod
    def from_dataset(
        cls,
        ds: xr.Dataset,
        *,
        model=None,
        data: xr.Dataset | str | os.PathLike | None = None,
    ) -> FitResult:
        """The `FitResult` of a `FIT.nc` dataset in memory (the inverse of
        `to_dataset`; the `fit` group of a posterior's `InferenceData`), read
        as `from_netcdf` reads a file; a data file the dataset names by a
        relative path is looked for in the working directory."""
        return cls(**fit_fields(ds, "the fit dataset", model=model, data=data))


def _plain(v: Any) -> Any:
    a = np.asarray(v)
    if a.ndim == 0:
        return float(a)
    return [float(x) for x in a.ravel()]


def _finite_or_none(v: Any) -> Any:
    if isinstance(v, float | np.floating) and not math.isfinite(v):
        return None
    return float(v) if isinstance(v, np.floating) else v
