"""One task, run on a worker: a calibrate (then forecasts), written atomically.

`run_task` is a plain function of paths and settings (a `TaskInput`), so
nothing compiled crosses a process boundary: each worker compiles what it runs,
through JAX's persistent compilation cache shared by all workers. A task that
raises records its error in its own file; only an interrupt (or a dead worker)
leaves no file, and atomic writes mean a task file on disk is complete.

Files per task, in `RESULTS/tasks/`: `KEY.fit.nc` (the task's `FIT.nc`),
`KEY.forecast-J.nc` (one per scenario file, or `KEY.forecast.nc` for the
baseline), then `KEY.nc`, the summary `batch.nc` is merged from, written
last, so its presence means the task is done. A bootstrap replicate writes
the data it drew, `KEY.data.nc`, before its `KEY.fit.nc` (and no forecast).
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["TASK_KIND", "TaskInput", "read_task", "run_task", "task_error"]

TASK_KIND = "batch_task"
TABLE = ("estimate", "se", "lower", "upper")


@dataclasses.dataclass(frozen=True)
class TaskInput:
    """What a worker needs to run one task: plain data, cheap to pickle."""

    key: str
    out_dir: str
    model: str
    data: str
    patch_index: int
    fit: str
    seed: int
    calibrate: Mapping[str, Any]
    forecast: Mapping[str, Any] | None
    fingerprint: str
    coordinates: Mapping[str, Any]
    x64: bool
    cache_dir: str | None  # None: the worker's default (EPIFIT_NO_CACHE: none)
    # a bootstrap replicate (replicate >= 0): the original task's key, the
    # kind of draw and the seed of the draws (`replicate_seed`)
    replicate: int = -1
    original_key: str = ""
    bootstrap_kind: str = ""
    replicate_seed: int = -1


def task_error(e: BaseException) -> str:
    """A one-line message: the error's kind and the last line of its text
    (JAX and Equinox put the reason last)."""
    text = str(e).strip()
    line = text.splitlines()[-1].strip() if text else ""
    return f"{type(e).__name__}: {line}" if line else type(e).__name__


def _configure(task: TaskInput) -> None:
    import jax

    jax.config.update("jax_enable_x64", task.x64)
    if task.cache_dir is None and os.environ.get("EPIFIT_NO_CACHE") is not None:
        return
    from epifit._cache import enable_compilation_cache

    # None: the worker's own default (EPIFIT_CACHE_DIR on a cluster's workers)
    enable_compilation_cache(task.cache_dir)


def _dataset(task: TaskInput):
    """The task's data: the file, or one patch of it (`split = "patch"`)."""
    if task.patch_index < 0:
        return task.data
    from epifit.data import PATCH, PATCH_TO, open_dataset

    ds = open_dataset(task.data).load()
    keep = [task.patch_index]
    ds = ds.isel({PATCH: keep})
    if PATCH_TO in ds.dims:
        ds = ds.isel({PATCH_TO: keep})
    return ds


def _replicate_data(task: TaskInput, out: Path, record: dict):
    """A replicate's data, drawn from its original's fit (written to
    `KEY.data.nc`, named in `record`), and that fit, the refit's start."""
    from epifit.batch._bootstrap import bootstrap_data
    from epifit.data import write_dataset
    from epifit.fitting import FitResult

    path = out / f"{task.original_key}.fit.nc"
    if not path.is_file():
        raise FileNotFoundError(
            f"the original task {task.original_key} has no fit file {path.name}"
        )
    data = _dataset(task)
    original = FitResult.from_netcdf(path, data=data)
    drawn = bootstrap_data(
        original, data, kind=task.bootstrap_kind, seed=task.replicate_seed
    )
    write_dataset(drawn, out / f"{task.key}.data.nc")
    record["data_file"] = f"{task.key}.data.nc"
    return drawn, original


def _fit(task: TaskInput, out: Path, record: dict):
    from epifit.fitting import calibrate

    if task.replicate >= 0:
        data, init = _replicate_data(task, out, record)
    else:
        data, init = _dataset(task), None
    with warnings.catch_warnings():
        # a fit stopped by non-finite losses says so in its message
        warnings.filterwarnings("ignore", message="stopped: ", category=RuntimeWarning)
        return calibrate(
            task.model,
            data,
            fit=task.fit or None,
            init=init,
            seed=task.seed,
            progress=False,
            **task.calibrate,
        )


def _median_cumulative(ds, spec) -> dict[str, float]:
    """Per scenario of a forecast, the median of the cumulative total (over
    the forecast days and the patches) of the model's first observation;
    NaN without a median among the forecast's quantiles."""
    name = f"cumulative_{spec.observations[0].name}_total"
    quantiles = [float(q) for q in ds["quantile"].values]
    out = {}
    for s in ds["scenario"].values:
        if name in ds and 0.5 in quantiles:
            out[str(s)] = float(ds[name].sel(scenario=s, quantile=0.5).values)
        else:
            out[str(s)] = float("nan")
    return out


def _forecasts(task: TaskInput, result, out: Path) -> tuple[list[str], dict]:
    """The forecasts of a fitted task, one file per scenario file, and the
    median cumulative of each of their scenarios (see `_median_cumulative`)."""
    if task.forecast is None:
        return [], {}
    from epifit.data import write_dataset
    from epifit.forecasting import forecast

    f = task.forecast
    scenario_files = list(f["scenarios"]) or [None]
    names, cumulative = [], {}
    for j, scenarios in enumerate(scenario_files):
        ds = forecast(
            result,
            () if scenarios is None else scenarios,
            days=f["days"],
            samples=f["samples"],
            seed=task.seed,
            observation_noise=f["observation_noise"],
        )
        name = (
            f"{task.key}.forecast.nc"
            if scenarios is None
            else f"{task.key}.forecast-{j}.nc"
        )
        write_dataset(ds, out / name)
        names.append(name)
        for s, v in _median_cumulative(ds, result.problem.spec).items():
            cumulative.setdefault(s, v)  # the baseline: the first file's
    return names, cumulative


def run_task(task: TaskInput) -> dict[str, Any]:
    """Run one task and write its files; returns a short summary
    (`key`, `status`, `error`, `wall_s`). Errors of the fit are recorded, not
    raised."""
    start = time.time()
    t0, cpu0 = time.perf_counter(), time.process_time()
    _configure(task)
    out = Path(task.out_dir)
    record: dict[str, Any] = {
        "status": "ok",
        "error": "",
        "fit_file": "",
        "data_file": "",
    }
    result = None
    try:
        result = _fit(task, out, record)
        fit_s = time.perf_counter() - t0
        from epifit.data import write_dataset

        write_dataset(result.to_dataset(), out / f"{task.key}.fit.nc")
        record["fit_file"] = f"{task.key}.fit.nc"
        record["forecast_files"], record["forecast_cumulative"] = _forecasts(
            task, result, out
        )
    except Exception as e:  # recorded in the task's file, the batch goes on
        record.update(status="failed", error=task_error(e))
        result = None
        fit_s = time.perf_counter() - t0
    record.update(
        start_time=start,
        end_time=time.time(),
        wall_s=time.perf_counter() - t0,
        cpu_s=time.process_time() - cpu0,
        fit_s=fit_s,
        host=socket.gethostname(),
        pid=os.getpid(),
    )
    _write_summary(task, result, record, out / f"{task.key}.nc")
    return {k: record[k] for k in ("status", "error", "wall_s")} | {"key": task.key}


def _write_summary(task: TaskInput, result, record: dict, path: Path) -> None:
    import xarray as xr

    from epifit.data import write_dataset

    rows = [] if result is None else result.table
    ds = xr.Dataset(
        {k: ("parameter", np.asarray([r[k] for r in rows], float)) for k in TABLE},
        coords={
            "parameter": ("parameter", [r["label"] for r in rows]),
            "parameter_name": ("parameter", [r["name"] for r in rows]),
        },
    )
    attrs = dict(
        epifit_kind=TASK_KIND,
        key=task.key,
        fingerprint=task.fingerprint,
        coordinates=json.dumps(dict(task.coordinates)),
        forecast_files=json.dumps(record.pop("forecast_files", [])),
        forecast_cumulative=json.dumps(record.pop("forecast_cumulative", {})),
        **record,
    )
    if result is not None:
        attrs.update(
            loss=float(result.loss),
            log_likelihood=float(result.log_likelihood),
            aic=float(result.aic),
            bic=float(result.bic),
            iterations=int(result.iterations),
            converged=int(bool(result.converged)),
            message=result.message,
            **{f"version_{k}": v for k, v in result.versions.items()},
            **{k: v for k, v in result.hashes.items() if v},
        )
    ds.attrs = attrs
    write_dataset(ds, path)


def read_task(path: str | os.PathLike):
    """A task file as a Dataset, or None when it is absent or not a complete
    task file (an older or foreign file is run again, not trusted)."""
    path = Path(path)
    if not path.is_file():
        return None
    from epifit.data import open_dataset

    try:
        with open_dataset(path) as ds:
            ds = ds.load()
    except (OSError, ValueError):
        return None
    if ds.attrs.get("epifit_kind") != TASK_KIND or "fingerprint" not in ds.attrs:
        return None
    return ds
