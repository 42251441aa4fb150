"""Batch benchmark: throughput of `epifit.batch.run_batch` with 1 and 2
workers, and its per-task overhead.

The tasks are small independent fits: the boarding-school SIR
(`models/sir.toml`, `models/sir_fit.toml`: Levenberg-Marquardt, Gauss-Newton
intervals) on `--datasets` variants of the outbreak (the counts scaled by
0.70 ... 1.00) x `--seeds` seeds, `--starts` starts and `--iterations`
iterations each: 4 x 4 = 16 fits by default.

Steps, all on one JAX persistent compilation cache in a fresh folder:

1. warm-up: one batch of one task per worker count, so every compiled
   program is in the cache (what a second batch of the same model sees);
2. `sequential`: the same fits one after another with `calibrate` in one
   fresh process with that cache (the baseline a batch must beat);
3. a batch of all the tasks with each worker count (`--workers`, default
   1 and 2), into fresh results folders.

Reported per run: `wall_s` (the whole `run_batch`, cluster start-up
included), `makespan_s` (first task start to last task end, from batch.nc),
throughput `tasks / makespan_s` and its ratio to 1 worker, the sum of the
tasks' calibrate times (`fit_s`), and two overheads per task:

* `overhead_s`: `(makespan_s x workers - sum(fit_s))/tasks`: the
  worker-seconds of a task outside its calibrate: idle time between tasks
  (scheduling, workers starting late) and result writing, with a warm cache;
* `vs_sequential_s`: `(makespan_s x workers - sequential_s)/tasks`: the
  worker-seconds a task costs beyond the same fit in one process.

The machine's load average is recorded before and after: on a shared
machine the figures are only as good as the quiet they were measured in.

    python benchmarks/batch.py --json out/batch.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "sir.toml"
FIT = ROOT / "models" / "sir_fit.toml"
DATA = ROOT / "data" / "boarding_school_1978.nc"

SEQUENTIAL = """
import json, sys, time
import jax
jax.config.update("jax_enable_x64", True)
from epifit import calibrate, enable_compilation_cache
enable_compilation_cache(sys.argv[2])
model, fit, settings, runs = json.loads(sys.argv[1])
t = time.perf_counter()
for data, seed in runs:
    calibrate(model, data, fit=fit, seed=seed, progress=False, **settings)
print(json.dumps({"sequential_s": time.perf_counter() - t}))
"""


def _datasets(folder: Path, n: int) -> list[Path]:
    import numpy as np

    from epifit.data import open_dataset, write_dataset

    ds = open_dataset(DATA)
    out = []
    for i, scale in enumerate(np.linspace(0.7, 1.0, n)):
        d = ds.copy(deep=True)
        d["in_bed"] = np.round(scale * d["in_bed"])
        out.append(write_dataset(d, folder / f"region{i}.nc"))
    return out


def _batch_file(folder: Path, name: str, data, seeds, a) -> Path:
    path = folder / name
    path.write_text(
        f'model = "{MODEL}"\nfit = "{FIT}"\n'
        f"data = {json.dumps([str(d) for d in data])}\nseeds = {json.dumps(seeds)}\n"
        f"[calibrate]\nmax_iterations = {a.iterations}\nn_starts = {a.starts}\n"
    )
    return path


def _run(batch: Path, out: Path, workers: int, cache: Path) -> dict:
    import numpy as np

    from epifit.batch import run_batch

    t = time.perf_counter()
    r = run_batch(batch, out, workers=workers, cache_dir=cache, progress=False)
    wall = time.perf_counter() - t
    ds = r.dataset
    if r.n_failed:
        raise RuntimeError(f"{r.n_failed} tasks failed: {set(ds['error'].values)}")
    start = ds["start_time"].values.astype("datetime64[ns]").astype(np.int64) / 1e9
    end = ds["end_time"].values.astype("datetime64[ns]").astype(np.int64) / 1e9
    n = ds.sizes["task"]
    makespan = float(end.max() - start.min())
    task_s, fit_s = float(ds["wall_s"].sum()), float(ds["fit_s"].sum())
    return dict(
        workers=workers,
        tasks=n,
        wall_s=wall,
        makespan_s=makespan,
        throughput_per_s=n / makespan,
        task_s=task_s,
        fit_s=fit_s,
        cpu_s=float(ds["cpu_s"].sum()),
        overhead_s=(makespan * workers - fit_s) / n,
    )


def _sequential(data, seeds, a, cache: Path) -> float:
    runs = [(str(d), s) for d in data for s in seeds]
    settings = {"max_iterations": a.iterations, "n_starts": a.starts}
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            SEQUENTIAL,
            json.dumps([str(MODEL), str(FIT), settings, runs]),
            str(cache),
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        check=True,
    )
    return json.loads(proc.stdout.splitlines()[-1])["sequential_s"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--datasets", type=int, default=4)
    p.add_argument("--seeds", type=int, default=4)
    p.add_argument("--starts", type=int, default=2)
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--workers", default="1,2", help="worker counts, e.g. 1,2")
    p.add_argument("--json", help="write the records to this file")
    a = p.parse_args(argv)
    import jax

    jax.config.update("jax_enable_x64", True)
    counts = [int(w) for w in a.workers.split(",")]
    records: dict = {"load_before": os.getloadavg(), "cores": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp:
        folder, cache = Path(tmp), Path(tmp) / "cache"
        data, seeds = _datasets(folder, a.datasets), list(range(a.seeds))
        warm = _batch_file(folder, "warm.toml", data[:1], [0], a)
        for w in counts:
            _run(warm, folder / f"warm{w}", w, cache)
        records["sequential_s"] = _sequential(data, seeds, a, cache)
        batch = _batch_file(folder, "batch.toml", data, seeds, a)
        runs = [_run(batch, folder / f"out{w}", w, cache) for w in counts]
    base = runs[0]["throughput_per_s"]
    for r in runs:
        r["speedup"] = r["throughput_per_s"] / base
        r["vs_sequential_s"] = (
            r["makespan_s"] * r["workers"] - records["sequential_s"]
        ) / r["tasks"]
    records.update(runs=runs, load_after=os.getloadavg())
    _table(records)
    if a.json:
        Path(a.json).write_text(json.dumps(records, indent=1))
    return 0


def _table(records: dict) -> None:
    print(
        f"load average before {records['load_before'][0]:.2f}, after "
        f"{records['load_after'][0]:.2f} ({records['cores']} cores); "
        f"sequential calibrate {records['sequential_s']:.1f} s"
    )
    cols = ("workers", "tasks", "wall_s", "makespan_s", "throughput_per_s")
    cols += ("speedup", "overhead_s", "vs_sequential_s")
    print(" ".join(f"{c:>16}" for c in cols))
    for r in records["runs"]:
        print(
            " ".join(
                f"{r[c]:>16.3f}" if isinstance(r[c], float) else f"{r[c]:>16}"
                for c in cols
            )
        )


if __name__ == "__main__":
    sys.exit(main())
