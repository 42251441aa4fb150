"""`batch.nc`: the task files of a batch merged along a `task` dimension,
with the bootstrap intervals of each original task and, with forecasts, a
`scenario` dimension."""

from __future__ import annotations

import datetime as _dt
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from epifit.batch._bootstrap import bootstrap_intervals
from epifit.batch._task import TABLE, read_task

__all__ = ["KIND", "merge_tasks"]

KIND = "batch"
# per-task numbers from the task file's attributes (NaN when absent: failed)
FLOATS = (
    "loss",
    "log_likelihood",
    "aic",
    "bic",
    "wall_s",
    "cpu_s",
    "fit_s",
)
TIMES = ("start_time", "end_time")  # unix seconds on the worker -> datetime64
INTS = ("iterations", "converged", "pid")
STRINGS = (
    "status",
    "error",
    "message",
    "fingerprint",
    "host",
    "fit_file",
    "data_file",
)
COORDS = ("model", "dataset", "patch", "fit", "seed", "replicate", "original")
INT_COORDS = ("seed", "replicate")


def merge_tasks(
    inputs: Sequence[Any],
    tasks_dir: Path,
    missing: Mapping[str, str],
    attrs: Mapping[str, Any],
    *,
    scenarios: Sequence[tuple[str, str]] = (),
    level: float = 0.95,
    root: Path | None = None,
):
    """One Dataset over (`task`, `parameter`) from the task files of `inputs`
    (`TaskInput`s, in order); a task without a file is `failed` with the error
    in `missing` (by key). `scenarios` (the batch's `(name, scenario file)`,
    see `BatchSpec.scenarios`) gives the `scenario` dimension; `level` the
    bootstrap intervals' level; `root` the folder the scenario files are
    named relative to."""
    import xarray as xr

    files = [read_task(tasks_dir / f"{t.key}.nc") for t in inputs]
    labels: list[str] = []
    names: dict[str, str] = {}
    for ds in files:
        for lab, name in zip(
            (ds["parameter"].values if ds is not None else []),
            (ds["parameter_name"].values if ds is not None else []),
            strict=True,
        ):
            if str(lab) not in names:
                labels.append(str(lab))
                names[str(lab)] = str(name)
    n, p = len(inputs), len(labels)
    where = {lab: j for j, lab in enumerate(labels)}
    table = {k: np.full((n, p), np.nan) for k in TABLE}
    rows: list[dict] = []
    for i, (task, ds) in enumerate(zip(inputs, files, strict=True)):
        if ds is None:
            why = missing.get(task.key, "no task file was written")
            rows.append({"status": "failed", "error": why})
            continue
        cols = [where[str(lab)] for lab in ds["parameter"].values]
        for k in TABLE:
            table[k][i, cols] = ds[k].values
        rows.append(dict(ds.attrs))
    out = xr.Dataset(
        {k: (("task", "parameter"), v) for k, v in table.items()},
        coords=_coordinates(inputs, labels, names),
    )
    for k in FLOATS:
        out[k] = ("task", np.asarray([float(r.get(k, np.nan)) for r in rows]))
    for k in TIMES:
        seconds = np.asarray([float(r.get(k, np.nan)) for r in rows])
        ns = np.where(np.isfinite(seconds), seconds * 1e9, np.nan)
        out[k] = ("task", _datetimes(ns))
    for k in INTS:
        out[k] = ("task", np.asarray([int(r.get(k, -1)) for r in rows], np.int64))
    for k in STRINGS:
        out[k] = ("task", np.asarray([str(r.get(k, "")) for r in rows], dtype=str))
    out["replicate_seed"] = (
        "task",
        np.asarray([int(t.replicate_seed) for t in inputs], np.int64),
    )
    _bootstrap_vars(out, inputs, level)
    if scenarios:
        out = _scenario_vars(out, inputs, rows, scenarios, root)
    _describe(out)
    out.attrs = dict(
        epifit_kind=KIND,
        created=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        n_tasks=n,
        n_ok=int(sum(r["status"] == "ok" for r in rows)),
        n_failed=int(sum(r["status"] != "ok" for r in rows)),
        bootstrap_level=level,
        **_versions(rows),
        **attrs,
    )
    return out


def _coordinates(inputs: Sequence[Any], labels: list[str], names: dict) -> dict:
    coords: dict[str, Any] = {
        "task": ("task", [t.key for t in inputs]),
        "task_index": ("task", np.arange(len(inputs))),
        "parameter": ("parameter", labels),
        "parameter_name": ("parameter", [names[lab] for lab in labels]),
    }
    for k in COORDS:
        values = [t.coordinates[k] for t in inputs]
        dtype = np.int64 if k in INT_COORDS else str
        coords[k] = ("task", np.asarray(values, dtype=dtype))
    return coords


def _bootstrap_vars(out, inputs: Sequence[Any], level: float) -> None:
    """`bootstrap_lower`, `bootstrap_upper` (task, parameter) and
    `bootstrap_n` (task) from the replicates' estimates."""
    position = {t.key: i for i, t in enumerate(inputs)}
    original = np.asarray([position[t.coordinates["original"]] for t in inputs])
    replicate = np.asarray([t.replicate for t in inputs])
    lower, upper, n = bootstrap_intervals(
        out["estimate"].values,
        original,
        replicate,
        out["status"].values == "ok",
        level,
    )
    dims = ("task", "parameter")
    pct = f"{100 * (1 - level) / 2:g} and {100 * (1 + level) / 2:g}"
    what = f"percentile of the ok bootstrap replicates' estimates ({pct})"
    out["bootstrap_lower"] = (dims, lower, {"long_name": f"lower {what}"})
    out["bootstrap_upper"] = (dims, upper, {"long_name": f"upper {what}"})
    out["bootstrap_n"] = (
        "task",
        n,
        {"long_name": "ok bootstrap replicates of the task (0 for replicates)"},
    )


def _scenario_vars(out, inputs, rows, scenarios, root):
    """The `scenario` dimension: per (task, scenario) the forecast file that
    holds the scenario and the median of its cumulative first observation."""
    names = [name for name, _ in scenarios]
    files = np.full((len(inputs), len(names)), "", dtype=object)
    cumulative = np.full((len(inputs), len(names)), np.nan)
    for i, (task, r) in enumerate(zip(inputs, rows, strict=True)):
        written = json.loads(r.get("forecast_files", "[]"))
        medians = json.loads(r.get("forecast_cumulative", "{}"))
        listed = list((task.forecast or {}).get("scenarios", []))
        for j, (name, file) in enumerate(scenarios):
            k = listed.index(file) if listed else 0
            if k < len(written):
                files[i, j] = written[k]
                cumulative[i, j] = float(medians.get(name, np.nan))
    out = out.assign_coords(
        scenario=("scenario", names),
        scenario_file=(
            "scenario",
            np.asarray([_relative(f, root) for _, f in scenarios], dtype=str),
        ),
    )
    out["forecast_file"] = (("task", "scenario"), files.astype(str))
    out["forecast_cumulative"] = (("task", "scenario"), cumulative)
    out["forecast_file"].attrs["long_name"] = (
        "the task's forecast holding the scenario, relative to tasks/"
    )
    out["forecast_cumulative"].attrs["long_name"] = (
        "median forecast of the first observation's total over the forecast "
        "days and patches"
    )
    return out


def _relative(path: str, root: Path | None) -> str:
    if not path or root is None:
        return path
    try:
        return str(Path(path).relative_to(root))
    except ValueError:
        return path


def _describe(ds) -> None:
    ds["status"].attrs["long_name"] = "'ok' or 'failed'"
    ds["error"].attrs["long_name"] = "why the task failed (empty when ok)"
    ds["wall_s"].attrs["long_name"] = "seconds the task ran on its worker"
    ds["fit_s"].attrs["long_name"] = "seconds of the task's calibrate"
    ds["cpu_s"].attrs["long_name"] = "CPU seconds of the task's worker process"
    ds["start_time"].attrs["long_name"] = "when the task started (UTC)"
    ds["end_time"].attrs["long_name"] = "when the task ended (UTC)"
    ds["fit_file"].attrs["long_name"] = "the task's FIT.nc, relative to tasks/"
    ds["data_file"].attrs["long_name"] = (
        "a bootstrap replicate's drawn data, relative to tasks/ (else empty)"
    )
    ds["replicate_seed"].attrs["long_name"] = (
        "the seed of a replicate's draws (-1 for an original task)"
    )


def _datetimes(ns: np.ndarray) -> np.ndarray:
    """Nanoseconds since the epoch (NaN: not known) as `datetime64[ns]`."""
    out = np.full(ns.shape, np.datetime64("NaT"), "datetime64[ns]")
    ok = np.isfinite(ns)
    out[ok] = ns[ok].astype(np.int64).astype("datetime64[ns]")
    return out


def _versions(rows: list[dict]) -> dict[str, str]:
    """The library versions of the first task that ran."""
    for r in rows:
        versions = {k: v for k, v in r.items() if k.startswith("version_")}
        if versions:
            return versions
    return {}
