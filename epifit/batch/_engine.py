"""The Dask distributed engine: a cluster, task submission, faults, progress.

By default an embedded `LocalCluster`: one single-threaded worker process per
core, spawned (not forked: JAX is multithreaded and deadlocks after a fork),
with XLA's intra-op threads limited to one (`worker_env`) so that N workers
use N cores, not N x N threads. `scheduler=` connects to an existing cluster
instead (its workers should get the same environment; see `docs/batch.md`).

A worker killed mid-task is replaced by its nanny and the task runs again
(the scheduler's `allowed-failures`, 3 by default); an exception escaping a
task (its file could not be written) is retried `RETRIES` times, then recorded
as a failure.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from epifit._workers import single_threaded_env

__all__ = ["RETRIES", "open_client", "run_tasks", "worker_env"]

RETRIES = 2


def worker_env(cache_dir: str | os.PathLike | None = None) -> dict[str, str]:
    """The environment of a batch worker: XLA limited to one thread (the
    flags appended to any `XLA_FLAGS` already set), BLAS to one thread, and
    the shared compilation cache (`EPIFIT_CACHE_DIR`); the sampler's chain
    workers get the same environment."""
    return single_threaded_env(cache_dir)


def _check_start_method() -> None:
    from distributed.utils import get_mp_context

    method = get_mp_context().get_start_method()
    if method == "fork":
        raise RuntimeError(
            "Dask config distributed.worker.multiprocessing-method is 'fork'; "
            "JAX deadlocks in forked workers: set it to 'spawn' (the default)."
        )


@contextlib.contextmanager
def open_client(
    *,
    workers: int | None = None,
    scheduler: str | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> Iterator[Any]:
    """A `distributed.Client`: on an embedded `LocalCluster` of `workers`
    single-threaded spawned processes (default: one per core), or connected
    to `scheduler` (`tcp://HOST:8786`). The cluster is closed on exit."""
    from distributed import Client, LocalCluster

    if scheduler is not None:
        if workers is not None:
            raise ValueError("Give --workers or --scheduler, not both.")
        with Client(scheduler, timeout="30s") as client:
            yield client
        return
    _check_start_method()
    n = workers if workers is not None else (os.cpu_count() or 1)
    if n < 1:
        raise ValueError(f"--workers must be at least 1, got {n}.")
    cluster = LocalCluster(
        n_workers=n,
        threads_per_worker=1,
        processes=True,
        env=worker_env(cache_dir),
        dashboard_address=":0",  # a free port: batches side by side
        silence_logs=logging.ERROR,
    )
    try:
        with Client(cluster) as client:
            yield client
    finally:
        cluster.close()


def _has_bokeh() -> bool:
    import importlib.util

    return importlib.util.find_spec("bokeh") is not None


def dashboard(client) -> str | None:
    """The dashboard address, when the cluster serves one."""
    try:
        info = client.scheduler_info()
    except Exception:  # pragma: no cover - a scheduler that went away
        return None
    if "dashboard" not in info.get("services", {}) or not _has_bokeh():
        return None  # without bokeh, the dashboard is a page asking for it
    return client.dashboard_link


def run_tasks(
    client,
    function: Callable[[Any], dict],
    inputs: Sequence[Any],
    *,
    on_done: Callable[[Any, dict], Sequence[Any] | None],
    progress: bool,
) -> None:
    """Submit `function(input)` for every input (one task each, pure=False,
    `RETRIES` retries), call `on_done(input, summary)` as each finishes (a
    task that still raises after its retries gets a summary with status
    `failed` and the error) and submit the inputs it returns (a bootstrap's
    replicates once their original is done), with a progress bar on stderr.
    An interrupt cancels what is left and raises again."""
    from distributed import wait

    futures: dict = {}

    def submit(xs) -> None:
        for x in xs:
            fut = client.submit(
                function,
                x,
                key=f"epifit-{x.key}-{time.time_ns()}",
                pure=False,
                retries=RETRIES,
            )
            futures[fut] = x
            pending.add(fut)

    pending: set = set()
    submit(inputs)
    bar = _Bar(len(futures), progress)
    try:
        with bar:
            while pending:
                try:
                    wait(pending, timeout=0.5, return_when="FIRST_COMPLETED")
                except TimeoutError:  # none finished: refresh the bar
                    pass
                done = {f for f in pending if f.done()}
                pending -= done
                for fut in done:
                    summary = _summary(fut, futures[fut])
                    then = list(on_done(futures[fut], summary) or ())
                    bar.advance(summary["status"] != "ok", more=len(then))
                    submit(then)
                bar.running(_running(client, pending))
    except BaseException:
        client.cancel(list(pending))
        raise


def _summary(fut, task) -> dict:
    from epifit.batch._task import task_error

    try:
        return fut.result()
    except Exception as e:  # raised after the retries, or the worker died too often
        return {
            "key": task.key,
            "status": "failed",
            "error": task_error(e),
            "wall_s": float("nan"),
        }


def _running(client, pending) -> int:
    keys = {f.key for f in pending}
    try:
        processing = client.processing()
    except Exception:  # pragma: no cover - scheduler busy or gone
        return 0
    return sum(1 for ks in processing.values() for k in ks if k in keys)


class _Bar:
    """A rich progress bar: tasks done and failed, running, ETA."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled = total, enabled
        self.failed = 0
        self._progress = None

    def __enter__(self):
        if self.enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(
                TextColumn("batch"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn(
                    "{task.fields[failed]} failed, {task.fields[running]} running"
                ),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=Console(file=sys.stderr),
            )
            self._progress.__enter__()
            self._id = self._progress.add_task(
                "batch", total=self.total, failed=0, running=0
            )
        return self

    def __exit__(self, *exc):
        if self._progress is not None:
            self._progress.__exit__(*exc)

    def advance(self, failed: bool, more: int = 0) -> None:
        """One task done (`failed` or not); `more` tasks submitted after it."""
        self.failed += failed
        self.total += more
        if self._progress is not None:
            self._progress.update(
                self._id, advance=1, failed=self.failed, total=self.total
            )

    def running(self, n: int) -> None:
        if self._progress is not None:
            self._progress.update(self._id, running=n)
