"""`epifit batch BATCH.toml --out RESULTS/`: many fits on Dask distributed."""

from __future__ import annotations

import argparse

import epifit.cli._flags as _flags
from epifit._paths import existing_file
from epifit.cli._json import dumps


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("batch", help="batch file (TOML): models, data, fits, seeds, ...")
    p.add_argument("--out", required=True, help="results folder: tasks/ and batch.nc")
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--workers",
        type=_flags.integer(1),
        metavar="N",
        help="worker processes of the embedded Dask cluster (default: one per core)",
    )
    where.add_argument(
        "--scheduler",
        metavar="ADDRESS",
        help="run on an existing Dask cluster, e.g. tcp://HOST:8786",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="run only the tasks whose file is missing or was made from other inputs",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print a JSON summary")


def _run(a) -> int:
    from epifit.batch import run_batch

    batch = existing_file(a.batch, "Batch")
    result = run_batch(
        batch,
        a.out,
        workers=a.workers,
        scheduler=a.scheduler,
        resume=a.resume,
        progress=False if a.no_progress else "auto",
    )
    if a.json:
        print(dumps(result.to_json()))
        return 1 if result.n_failed else 0
    skipped = f", {len(result.skipped)} kept from before" if result.skipped else ""
    print(
        f"{result.n_ok + result.n_failed} tasks: {result.n_ok} ok, "
        f"{result.n_failed} failed ({len(result.ran)} run now{skipped}); "
        f"wrote {result.path}"
    )
    ds = result.dataset
    for key, error in zip(ds["task"].values, ds["error"].values, strict=True):
        if error:
            print(f"  {key} failed: {error}")
    return 1 if result.n_failed else 0


COMMAND = (
    "run many calibrations (and forecasts) on Dask; merge them into batch.nc",
    _add_arguments,
    _run,
)
