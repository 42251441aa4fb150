"""`BATCH.toml`: a batch of independent tasks declared as a product of axes.

A batch file names one model or a list, datasets (a list, a glob, or both),
optionally `split = "patch"` (one fit per patch of each dataset), fit
configurations, seeds and, in a `[forecast]` table, a forecast after each fit
for each of a list of scenario files. Every combination is one task: a
calibrate, then the forecasts. A `bootstrap` table adds, per task, `replicates`
refits of data simulated from its fit (tasks of their own, run once their
original is done). Paths are relative to the batch file's folder or absolute.
Every bad field fails with a `BatchError` naming the file and the field.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import itertools
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from epifit._errors import LocatedError
from epifit._toml import Reader, at

__all__ = [
    "BatchError",
    "BatchSpec",
    "Bootstrap",
    "Task",
    "load_batch",
    "parse_batch",
]

SPLITS = ("patch",)
# the calibrate keywords a `[calibrate]` table may set (the fit file's fields
# of the same names, applied on top of it)
CALIBRATE_KEYS = (
    "n_starts",
    "max_iterations",
    "tolerance",
    "loss_tolerance",
    "time_budget",
    "perturbation",
    "rtol",
    "atol",
    "max_steps",
    "chunk_size",
    "level",
    "uncertainty",
)
UNCERTAINTY = ("auto", "gauss_newton", "hessian", "none")
FORECAST_KEYS = ("days", "samples", "scenarios", "observation_noise")
BOOTSTRAP_KEYS = ("replicates", "kind", "seed", "level")
BOOTSTRAP_KINDS = ("parametric", "residual")
TOP_KEYS = (
    "description",
    "model",
    "data",
    "split",
    "fit",
    "seeds",
    "calibrate",
    "forecast",
    "bootstrap",
)


class BatchError(LocatedError):
    """A bad batch file or batch argument: names the file and the field."""


class _Reader(Reader):
    error = BatchError


@dataclasses.dataclass(frozen=True)
class Bootstrap:
    """The `bootstrap` table: `replicates` refits per task of data drawn from
    its fit (`kind`: `parametric`, each observation's noise family at the
    fitted values; `residual`, the fit's residuals resampled), seeded from
    `seed`, summarised by percentile intervals at `level`."""

    replicates: int
    kind: str = "parametric"
    seed: int = 0
    level: float = 0.95


@dataclasses.dataclass(frozen=True)
class Task:
    """One task of a batch: a calibrate of `model` on `data` (one `patch` of
    it when split), with fit configuration `fit` and `seed`, then a forecast
    per scenario file of `forecast` (none without a `[forecast]` table).

    A bootstrap replicate (`replicate >= 0`) refits data simulated from the
    fit of task `original` (an index into `BatchSpec.tasks`; an original task
    is its own, with `replicate = -1`) and makes no forecast.

    `key` names the task's files (`tasks/KEY.nc`); it is a hash of the task's
    coordinates (and the replicate's number), so adding a seed or replicates
    to a batch leaves the other tasks' files where they are."""

    index: int
    model: str
    data: str
    patch: str
    patch_index: int
    fit: str
    seed: int
    calibrate: Mapping[str, Any]
    forecast: Mapping[str, Any] | None
    replicate: int = -1
    original: int = -1

    @property
    def key(self) -> str:
        coords = [self.model, self.data, self.patch, self.fit, self.seed]
        if self.replicate >= 0:
            coords.append(self.replicate)
        digest = hashlib.sha256(json.dumps(coords).encode()).hexdigest()
        return f"task-{digest[:12]}"

    def coordinates(self, root: Path) -> dict[str, Any]:
        """The task's coordinates for `batch.nc`: files relative to `root`
        (the batch file's folder) where they lie below it."""
        return dict(
            model=_relative(self.model, root),
            dataset=_relative(self.data, root),
            patch=self.patch,
            fit=_relative(self.fit, root) if self.fit else "",
            seed=self.seed,
            replicate=self.replicate,
        )


@dataclasses.dataclass(frozen=True)
class BatchSpec:
    """A parsed batch file: its tasks and where it came from."""

    source: str | None
    root: Path
    text: str
    description: str
    tasks: tuple[Task, ...]
    bootstrap: Bootstrap | None = None
    # the batch's scenarios: (name, scenario file) in order, the baseline first
    # (its file: the first one's forecast holds it); () without [forecast]
    scenarios: tuple[tuple[str, str], ...] = ()


def load_batch(path: str | os.PathLike) -> BatchSpec:
    """Read and check a `BATCH.toml` (see the module docstring)."""
    path = Path(path)
    r = _Reader(str(path))
    data = r.toml_file(path, "Batch")
    return parse_batch(
        data, root=path.resolve().parent, file=str(path), text=path.read_text()
    )


def parse_batch(
    data: Mapping[str, Any],
    *,
    root: str | os.PathLike = ".",
    file: str = "batch",
    text: str = "",
) -> BatchSpec:
    """A batch from the tables of a batch file (paths relative to `root`)."""
    r = _Reader(file)
    root = Path(root).resolve()
    t = r.table(
        data, None, required=("model", "data"), optional=TOP_KEYS[:1] + TOP_KEYS[3:]
    )
    models = [
        _file(r, root, p, loc, "Model") for p, loc in _paths(r, t["model"], "model")
    ]
    datasets = _datasets(r, root, t["data"])
    fits = [""]
    if "fit" in t:
        fits = [_file(r, root, p, loc, "Fit") for p, loc in _paths(r, t["fit"], "fit")]
    seeds = _seeds(r, t.get("seeds", [0]))
    split = r.choice(t["split"], "split", SPLITS) if "split" in t else None
    calibrate = _calibrate(r, t.get("calibrate", {}))
    forecast = _forecast(r, root, t["forecast"]) if "forecast" in t else None
    bootstrap = _bootstrap(r, t["bootstrap"]) if "bootstrap" in t else None
    _check_inputs(r, models, fits)
    scenarios = () if forecast is None else _scenario_names(r, forecast["scenarios"])
    units = [(d, "", -1) for d in datasets] if split is None else _patches(r, datasets)
    originals = [
        Task(i, m, d, patch, k, f, s, calibrate, forecast, original=i)
        for i, (m, (d, patch, k), f, s) in enumerate(
            itertools.product(models, units, fits, seeds)
        )
    ]
    replicates = [] if bootstrap is None else _replicates(originals, bootstrap)
    tasks = tuple(originals + replicates)
    keys = [task.key for task in tasks]
    if len(set(keys)) != len(keys):
        raise r.fail(None, "two tasks are the same; list each file and seed once")
    description = str(t.get("description", ""))
    return BatchSpec(file, root, text, description, tasks, bootstrap, scenarios)


def _replicates(originals: list[Task], bootstrap: Bootstrap) -> list[Task]:
    """`bootstrap.replicates` replicate tasks per original, in order."""
    n = len(originals)
    return [
        dataclasses.replace(
            task,
            index=n + i * bootstrap.replicates + j,
            forecast=None,
            replicate=j,
            original=task.index,
        )
        for i, task in enumerate(originals)
        for j in range(bootstrap.replicates)
    ]


def _bootstrap(r: _Reader, value: Any) -> Bootstrap:
    t = r.table(value, "bootstrap", required=("replicates",), optional=BOOTSTRAP_KEYS)
    level = 0.95
    if "level" in t:
        level = r.number(t["level"], "bootstrap.level")
        if not 0.0 < level < 1.0:
            raise r.fail("bootstrap.level", f"must be in (0, 1), got {level!r}")
    return Bootstrap(
        replicates=r.integer(t["replicates"], "bootstrap.replicates", 1),
        kind=r.choice(t.get("kind", "parametric"), "bootstrap.kind", BOOTSTRAP_KINDS),
        seed=r.integer(t.get("seed", 0), "bootstrap.seed", 0),
        level=level,
    )


def _scenario_names(r: _Reader, files: list[str]) -> tuple[tuple[str, str], ...]:
    """The batch's scenario axis: the baseline, then each file's scenarios
    (a name in two files is refused: its forecasts could not be told apart)."""
    from epifit.forecasting import BASELINE, ScenarioError, load_scenarios

    out = {BASELINE: files[0] if files else ""}
    for i, f in enumerate(files):
        try:
            names = load_scenarios(f).names
        except ScenarioError as e:
            raise r.fail(at("forecast.scenarios", i), str(e)) from None
        for name in names:
            if name != BASELINE and name in out:
                raise r.fail(
                    at("forecast.scenarios", i),
                    f"scenario {name!r} of {f} is also in {out[name]}; give each "
                    "scenario one name across the scenario files",
                )
            out.setdefault(name, f)
    return tuple(out.items())


def _paths(r: _Reader, value: Any, location: str) -> list[tuple[str, str]]:
    """A string or a non-empty list of strings, with their locations."""
    if isinstance(value, str):
        return [(r.string(value, location), location)]
    items = r.array(value, location)
    return [
        (r.string(v, at(location, i)), at(location, i)) for i, v in enumerate(items)
    ]


def _file(r: _Reader, root: Path, path: str, location: str, what: str) -> str:
    p = Path(path) if Path(path).is_absolute() else root / path
    if not p.is_file():
        why = "is a directory" if p.is_dir() else "does not exist"
        raise r.fail(location, f"{what} file {p} {why}")
    return str(p.resolve())


def _datasets(r: _Reader, root: Path, value: Any) -> list[str]:
    """The data files: each entry a path or a glob (sorted), none twice."""
    out: list[str] = []
    for path, loc in _paths(r, value, "data"):
        if glob.has_magic(path):
            pattern = path if Path(path).is_absolute() else str(root / path)
            found = sorted(p for p in glob.glob(pattern) if Path(p).is_file())
            if not found:
                raise r.fail(loc, f"glob {path!r} matches no file (in {root})")
            files = [str(Path(p).resolve()) for p in found]
        else:
            files = [_file(r, root, path, loc, "Data")]
        for f in files:
            if f in out:
                raise r.fail(loc, f"data file {f} is listed twice")
            out.append(f)
    return out


def _seeds(r: _Reader, value: Any) -> list[int]:
    seeds = [
        r.integer(v, at("seeds", i), 0) for i, v in enumerate(r.array(value, "seeds"))
    ]
    if len(set(seeds)) != len(seeds):
        raise r.fail("seeds", f"a seed is listed twice: {seeds}")
    return seeds


def _calibrate(r: _Reader, value: Any) -> dict[str, Any]:
    """The `[calibrate]` keywords, checked as a fit file's fields are."""
    from epifit.fitting import check_fit_settings

    t = r.table(value, "calibrate", optional=CALIBRATE_KEYS)
    out = {}
    if "uncertainty" in t:
        v = t.pop("uncertainty")
        out["uncertainty"] = (
            r.boolean(v, "calibrate.uncertainty")
            if isinstance(v, bool)
            else r.choice(v, "calibrate.uncertainty", UNCERTAINTY)
        )
    try:
        out.update(
            check_fit_settings(
                t, file=r.file or "batch", names={k: f"calibrate.{k}" for k in t}
            )
        )
    except LocatedError as e:  # the FitConfigError of a field
        raise r.fail(e.location, e.reason) from None
    return out


def _forecast(r: _Reader, root: Path, value: Any) -> dict[str, Any]:
    t = r.table(value, "forecast", required=("days",), optional=FORECAST_KEYS)
    out: dict[str, Any] = {
        "days": r.integer(t["days"], "forecast.days", 1),
        "samples": r.integer(t.get("samples", 100), "forecast.samples", 0),
        "observation_noise": r.boolean(
            t.get("observation_noise", True), "forecast.observation_noise"
        ),
        "scenarios": [],
    }
    if "scenarios" in t:
        out["scenarios"] = [
            _file(r, root, p, loc, "Scenario")
            for p, loc in _paths(r, t["scenarios"], "forecast.scenarios")
        ]
    return out


def _check_inputs(r: _Reader, models: list[str], fits: list[str]) -> None:
    """Every model and fit file parses, before any worker starts."""
    from epifit.fitting import load_fit_config
    from epifit.model import load_model

    for i, m in enumerate(models):
        if models.index(m) != i:
            raise r.fail("model", f"model file {m} is listed twice")
        load_model(m)
    for i, f in enumerate(fits):
        if not f:  # no fit file: calibrate's defaults
            continue
        if fits.index(f) != i:
            raise r.fail("fit", f"fit file {f} is listed twice")
        load_fit_config(f)


def _patches(r: _Reader, datasets: list[str]) -> list[tuple[str, str, int]]:
    """`split = "patch"`: one unit per patch of each dataset."""
    from epifit.data import PATCH, open_dataset

    out = []
    for d in datasets:
        ds = open_dataset(d)
        if PATCH not in ds.dims:
            raise r.fail("split", f"dataset {d} has no '{PATCH}' dimension to split")
        labels = (
            [str(v) for v in ds[PATCH].values]
            if PATCH in ds.coords
            else [str(i) for i in range(ds.sizes[PATCH])]
        )
        out.extend((d, label, i) for i, label in enumerate(labels))
    return out


def _relative(path: str, root: Path) -> str:
    try:
        return str(Path(path).relative_to(root))
    except ValueError:
        return path
