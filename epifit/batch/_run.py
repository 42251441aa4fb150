"""`run_batch`: a batch file's tasks on Dask distributed, merged to `batch.nc`."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from epifit._paths import (
    file_sha256,
    output_file,
    output_lock,
    remove_stale_temporaries,
)
from epifit.batch._bootstrap import replicate_seed
from epifit.batch._engine import dashboard, open_client, run_tasks
from epifit.batch._merge import merge_tasks
from epifit.batch._spec import BatchError, BatchSpec, load_batch
from epifit.batch._task import TaskInput, read_task, run_task

__all__ = ["BatchResult", "run_batch"]


@dataclasses.dataclass
class BatchResult:
    """What [`run_batch`][epifit.batch.run_batch] did.

    Attributes:
        path: the merged `batch.nc`.
        dataset: its contents.
        ran: the keys of the tasks run now; skipped: those kept (`resume`);
            neither: the replicates of failed originals (failed, not run).
        n_ok, n_failed: tasks `ok` and `failed` in `batch.nc`.
        dashboard: the Dask dashboard's address, when there was one.
    """

    path: Path
    dataset: Any
    ran: list[str]
    skipped: list[str]
    n_ok: int
    n_failed: int
    dashboard: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dict(
            out=str(self.path),
            tasks=self.n_ok + self.n_failed,
            ran=len(self.ran),
            skipped=len(self.skipped),
            ok=self.n_ok,
            failed=self.n_failed,
            dashboard=self.dashboard,
        )


def run_batch(
    batch: str | os.PathLike | BatchSpec,
    out: str | os.PathLike,
    *,
    workers: int | None = None,
    scheduler: str | None = None,
    resume: bool = False,
    progress: bool | str = "auto",
    cache_dir: str | os.PathLike | None = None,
) -> BatchResult:
    """Run every task of a batch and merge the results into `OUT/batch.nc`.

    Each task (a calibrate, then its forecasts; see `docs/batch.md`) runs on
    a Dask worker and writes `OUT/tasks/KEY.nc` atomically; a task that fails
    records its error there and the others go on. A bootstrap replicate is
    submitted once its original task has written an ok fit (a replicate of a
    failed original is failed, with no file). The tasks run in the current
    precision (`jax_enable_x64`).

    Args:
        batch: a `BATCH.toml` path or a parsed `BatchSpec`.
        out: the results folder (created if absent; its parent must exist).
        workers: worker processes of the embedded `LocalCluster` (default:
            one per core).
        scheduler: the address of an existing Dask scheduler instead.
        resume: run only the tasks whose file is missing or was written for
            other inputs (its fingerprint: model, data, fit and scenario
            files' SHA-256, the settings, the precision; a replicate's: its
            original's with the bootstrap's kind, seed and number).
        progress: a progress bar on stderr: `True`, `False` or `"auto"` (when
            stderr is a terminal).
        cache_dir: JAX's persistent compilation cache the workers share
            (default: `epifit.enable_compilation_cache`'s folder, none when
            `EPIFIT_NO_CACHE` is set; with `scheduler`, each worker's own
            default, `EPIFIT_CACHE_DIR` of its environment).

    Returns:
        A [`BatchResult`][epifit.batch.BatchResult].

    Raises:
        BatchError: a bad batch file (naming file and field).
        OutputError: `OUT/batch.nc` is an input, or another batch is writing it.
    """
    import jax

    spec = batch if isinstance(batch, BatchSpec) else load_batch(batch)
    out_dir, tasks_dir, merged = _outputs(spec, out)
    cache = _cache(cache_dir) if scheduler is None else cache_dir
    x64 = bool(jax.config.jax_enable_x64)
    inputs = _inputs(spec, tasks_dir, x64, str(cache) if cache else None)
    with output_lock(merged):
        todo = [t for t in inputs if not (resume and _done(t, tasks_dir))]
        missing: dict[str, str] = {}
        link = None
        _clean(tasks_dir)
        plan = _Plan(inputs, todo, tasks_dir, missing)
        try:
            if plan.first:
                link = _run(plan, workers, scheduler, cache, progress)
        finally:
            _clean(tasks_dir)  # temporaries of killed writers
        attrs = _attributes(spec, workers, scheduler)
        level = spec.bootstrap.level if spec.bootstrap is not None else 0.95
        ds = merge_tasks(
            inputs,
            tasks_dir,
            missing,
            attrs,
            scenarios=spec.scenarios,
            level=level,
            root=spec.root,
        )
        from epifit.data import write_dataset

        write_dataset(ds, merged)
    done, kept = plan.submitted, {t.key for t in inputs} - {t.key for t in todo}
    return BatchResult(
        path=merged,
        dataset=ds,
        ran=[t.key for t in inputs if t.key in done],
        skipped=[t.key for t in inputs if t.key in kept],
        n_ok=int(ds.attrs["n_ok"]),
        n_failed=int(ds.attrs["n_failed"]),
        dashboard=link,
    )


class _Plan:
    """What runs: the originals to do, then each replicate to do once its
    original has an ok fit (now, for an original kept by `resume`; else when
    it finishes). A replicate whose original failed is recorded as failed in
    `missing` and never submitted."""

    def __init__(self, inputs, todo, tasks_dir: Path, missing: dict[str, str]):
        self.tasks_dir, self.missing = tasks_dir, missing
        self.submitted: set[str] = set()
        todo_keys = {t.key for t in todo}
        self.waiting: dict[str, list[TaskInput]] = {}
        self.first: list[TaskInput] = []
        for t in todo:
            if t.replicate < 0:
                self.first.append(t)
            elif t.original_key in todo_keys:
                self.waiting.setdefault(t.original_key, []).append(t)
            else:  # its original was kept: run it now, or fail it
                self.first.extend(self._ready(t.original_key, [t]))
        self.submitted.update(t.key for t in self.first)

    def _ready(self, original: str, replicates: list[TaskInput]) -> list[TaskInput]:
        ds = read_task(self.tasks_dir / f"{original}.nc")
        if ds is not None and ds.attrs.get("status") == "ok":
            return replicates
        why = "no task file" if ds is None else ds.attrs.get("error", "")
        for t in replicates:
            self.missing[t.key] = f"the original task {original} failed: {why}"
        return []

    def on_done(self, task: TaskInput, summary: dict) -> list[TaskInput]:
        """Record a task that left no file; the replicates it lets run."""
        if (
            summary["status"] != "ok"
            and not (Path(task.out_dir) / f"{task.key}.nc").is_file()
        ):
            self.missing[task.key] = summary["error"]
        then = self._ready(task.key, self.waiting.pop(task.key, []))
        self.submitted.update(t.key for t in then)
        return then


def _run(plan: _Plan, workers, scheduler, cache, progress) -> str | None:
    show = sys.stderr.isatty() if progress == "auto" else bool(progress)
    with open_client(workers=workers, scheduler=scheduler, cache_dir=cache) as client:
        link = dashboard(client)
        if link:
            print(f"epifit batch: Dask dashboard at {link}", file=sys.stderr)
        run_tasks(client, run_task, plan.first, on_done=plan.on_done, progress=show)
    return link


def _outputs(spec: BatchSpec, out) -> tuple[Path, Path, Path]:
    """The results folder, its `tasks/` and `batch.nc`, checked before any work."""
    out_dir = Path(out)
    if out_dir.exists() and not out_dir.is_dir():
        raise BatchError(
            f"{out_dir} exists and is not a folder; give a folder", location="--out"
        )
    if not out_dir.parent.is_dir():
        raise FileNotFoundError(
            f"Cannot write --out {out_dir}: folder {out_dir.parent} does not exist."
        )
    out_dir.mkdir(exist_ok=True)
    tasks_dir = out_dir / "tasks"
    tasks_dir.mkdir(exist_ok=True)
    inputs = {}
    for t in spec.tasks:
        inputs.update({f"model {t.model}": t.model, f"data {t.data}": t.data})
        if t.fit:
            inputs[f"fit {t.fit}"] = t.fit
    if spec.source:
        inputs["the batch file"] = spec.source
    merged = output_file(out_dir / "batch.nc", inputs=inputs)
    return out_dir, tasks_dir, merged


def _cache(cache_dir) -> Path | None:
    if cache_dir is not None:
        return Path(cache_dir)
    if os.environ.get("EPIFIT_NO_CACHE") is not None:
        return None
    from epifit._cache import cache_dir as default

    return default()


def _inputs(
    spec: BatchSpec, tasks_dir: Path, x64: bool, cache: str | None
) -> list[TaskInput]:
    shas: dict[str, str | None] = {}

    def sha(path: str) -> str | None:
        if path not in shas:
            shas[path] = file_sha256(path)
        return shas[path]

    out: list[TaskInput] = []
    for t in spec.tasks:
        if t.replicate >= 0:
            out.append(_replicate_input(spec, out[t.original], t))
            continue
        forecast = None if t.forecast is None else dict(t.forecast)
        scenario_shas = [sha(s) for s in (forecast or {}).get("scenarios", [])]
        fingerprint = _hash(
            model=sha(t.model),
            data=sha(t.data),
            fit=sha(t.fit) if t.fit else None,
            scenarios=scenario_shas,
            patch=t.patch,
            seed=t.seed,
            calibrate=dict(t.calibrate),
            forecast={k: v for k, v in (forecast or {}).items() if k != "scenarios"},
            x64=x64,
        )
        out.append(
            TaskInput(
                key=t.key,
                out_dir=str(tasks_dir.resolve()),
                model=t.model,
                data=t.data,
                patch_index=t.patch_index,
                fit=t.fit,
                seed=t.seed,
                calibrate=dict(t.calibrate),
                forecast=forecast,
                fingerprint=fingerprint,
                coordinates=t.coordinates(spec.root) | {"original": t.key},
                x64=x64,
                cache_dir=cache,
            )
        )
    return out


def _replicate_input(spec: BatchSpec, original: TaskInput, t) -> TaskInput:
    """A replicate's input: its original's, refitting data drawn with the
    replicate's seed, without forecasts."""
    b = spec.bootstrap
    seed = replicate_seed(b.seed, original.key, t.replicate)
    fingerprint = _hash(
        original=original.fingerprint,
        kind=b.kind,
        seed=b.seed,
        replicate=t.replicate,
        replicate_seed=seed,
    )
    return dataclasses.replace(
        original,
        key=t.key,
        forecast=None,
        fingerprint=fingerprint,
        coordinates=dict(original.coordinates) | {"replicate": t.replicate},
        replicate=t.replicate,
        original_key=original.key,
        bootstrap_kind=b.kind,
        replicate_seed=seed,
    )


def _hash(**fields) -> str:
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _done(task: TaskInput, tasks_dir: Path) -> bool:
    """The task's file exists, is complete and has the task's fingerprint."""
    ds = read_task(tasks_dir / f"{task.key}.nc")
    return ds is not None and ds.attrs["fingerprint"] == task.fingerprint


def _clean(tasks_dir: Path) -> None:
    """Remove the temporaries (`.NAME.PID.HEX.tmp`) of writers no longer alive."""
    names = {
        p.name[1:].rsplit(".", 3)[0] for p in tasks_dir.glob(".*.tmp") if p.is_file()
    }
    for name in names:
        remove_stale_temporaries(tasks_dir / name)


def _attributes(spec: BatchSpec, workers, scheduler) -> dict[str, Any]:
    engine = (
        f"scheduler {scheduler}"
        if scheduler
        else f"LocalCluster, {workers or os.cpu_count()} workers"
    )
    return dict(
        title="epifit batch" + (f": {spec.description}" if spec.description else ""),
        batch_file=spec.source or "",
        batch_text=spec.text,
        engine=engine,
    )
