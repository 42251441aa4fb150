"""Command-line benchmark: what a user waits for at the shell.

`epifit calibrate` of the demo model (`models/seird_metapop_counts.toml` on
`data/synthetic_metapop_20.nc`, `--max-iterations 50 --no-uncertainty`, in
float64, the CLI's default) in fresh processes, each timed from its start to
its exit:

* `cold`: once with an empty persistent compilation cache (a fresh
  `EPIFIT_CACHE_DIR`), so every program is compiled;
* `warm`: `--warm-runs` times after it on that cache (the programs read
  back, nothing compiled): what a batch script or a second run pays.

Beside them, the import of `jax` and of epifit's calibration path in a fresh
interpreter (`--imports` times each, median), which every `epifit` command,
batch worker and notebook kernel pays, with the versions of jax, jaxlib,
NumPy and ml_dtypes (ml_dtypes 0.7.0 took 0.6 s to import beside NumPy 2.4,
about as long as the rest of jax; `pyproject.toml` excludes it). The runs
must agree on the final loss. Targets (issue 21): cold at most 12 s, warm at
most 4 s, printed beside the figures.

    python benchmarks/cli.py --json out/bench_cli.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h  # noqa: E402

MODEL = h.ROOT / "models" / "seird_metapop_counts.toml"
DATA = h.ROOT / "data" / "synthetic_metapop_20.nc"
IMPORTS = {
    "import_jax_s": "import jax",
    "import_epifit_s": "import epifit.fitting, epifit.cli",
}
PACKAGES = ("jax", "jaxlib", "numpy", "ml_dtypes")


def _env(cache: Path) -> dict:
    env = dict(os.environ, EPIFIT_CACHE_DIR=str(cache))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the CLI's own cache folder
    return env


def _calibrate(a, cache: Path, out: Path) -> dict:
    """One `epifit calibrate` process: its wall time and the fit's loss."""
    cmd = [sys.executable, "-m", "epifit", "calibrate", str(a.model)]
    cmd += ["--data", str(a.data), "--max-iterations", str(a.max_iter)]
    cmd += ["--no-uncertainty", "--out", str(out)]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(cache))
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise SystemExit(f"epifit calibrate failed (exit {proc.returncode}): {tail}")
    import xarray as xr

    with xr.open_dataset(out) as ds:
        return {"wall_s": wall, "loss": float(ds.attrs["loss"])}


def _import_s(statement: str, n: int) -> float:
    """Median time of `statement` in `n` fresh interpreters."""
    code = f"import time; t = time.perf_counter(); {statement}; "
    code += "print(time.perf_counter() - t)"
    times = []
    for _ in range(n):
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        )
        times.append(float(proc.stdout))
    return statistics.median(times)


def measure(a) -> dict:
    from importlib.metadata import version  # the runs' own environment

    rec = {
        "config": "epifit-cli-calibrate",
        "model": Path(a.model).name,
        "data": Path(a.data).name,
        "max_iter": a.max_iter,
        **{package: version(package) for package in PACKAGES},
    }
    for key, statement in IMPORTS.items():
        rec[key] = _import_s(statement, a.imports)
    with tempfile.TemporaryDirectory(prefix="epifit-bench-cli-") as tmp:
        cache, out = Path(tmp) / "cache", Path(tmp) / "fit.nc"
        cold = _calibrate(a, cache, out)
        warm = [_calibrate(a, cache, out) for _ in range(a.warm_runs)]
    rec["cold_s"] = cold["wall_s"]
    rec["warm_s"] = [w["wall_s"] for w in warm]
    rec["warm_median_s"] = statistics.median(rec["warm_s"]) if warm else None
    rec["loss"] = cold["loss"]
    losses = {cold["loss"], *(w["loss"] for w in warm)}
    if len(losses) != 1:  # a warm run must be the cold run, read from the cache
        raise SystemExit(f"the runs' final losses differ: {sorted(losses)}")
    rec["cold_target_s"], rec["warm_target_s"] = a.cold_target, a.warm_target
    rec["cold_met"] = rec["cold_s"] <= a.cold_target
    rec["warm_met"] = warm != [] and rec["warm_median_s"] <= a.warm_target
    return rec


def report(rec: dict) -> str:
    warm = ", ".join(f"{w:.2f}" for w in rec["warm_s"]) or "-"
    lines = [
        f"jax {rec['jax']}, jaxlib {rec['jaxlib']}, numpy {rec['numpy']}, "
        f"ml_dtypes {rec['ml_dtypes']}",
        f"import jax {rec['import_jax_s']:.2f} s; "
        f"import epifit's calibration path {rec['import_epifit_s']:.2f} s",
        f"epifit calibrate {rec['model']} --data {rec['data']} "
        f"--max-iterations {rec['max_iter']} --no-uncertainty:",
        f"  cold {rec['cold_s']:.2f} s (target {rec['cold_target_s']:g} s: "
        f"{'met' if rec['cold_met'] else 'NOT met'})",
        f"  warm {warm} s, median "
        + ("-" if rec["warm_median_s"] is None else f"{rec['warm_median_s']:.2f}")
        + f" s (target {rec['warm_target_s']:g} s: "
        f"{'met' if rec['warm_met'] else 'NOT met'})",
        f"  final loss {rec['loss']:.10g} in every run",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(MODEL))
    p.add_argument("--data", default=str(DATA))
    p.add_argument("--max-iterations", dest="max_iter", type=int, default=50)
    p.add_argument("--warm-runs", type=int, default=3)
    p.add_argument("--imports", type=int, default=3, help="interpreters per import")
    p.add_argument("--cold-target", type=float, default=12.0)
    p.add_argument("--warm-target", type=float, default=4.0)
    p.add_argument("--json", help="write the record (a list of one) to this file")
    a = p.parse_args(argv)
    if a.warm_runs < 0 or a.imports < 1 or a.max_iter < 1:
        p.error("--warm-runs must be >= 0, --imports and --max-iterations >= 1")
    rec = measure(a)
    print(report(rec))
    h.write_json(a.json, [rec])
    return 0


if __name__ == "__main__":
    sys.exit(main())
