"""Shared machinery of the benchmarks: the reference problem, workers, timing, tables.

Each measurement runs in its own Python process (a *worker*), so that peak RSS,
compile caches and memory belong to one configuration alone. The reference
problem and the peers' losses are defined here, in `benchmarks/reference/`
(`problem.py`, `peers.py`; see `benchmarks/README.md`); epifit itself never
imports them.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
TESTS = ROOT / "tests"


def reference_problem():
    """The module `reference.problem`, with `benchmarks/` (for `reference`)
    and `tests/` (for `helpers`, which maps the reference's flat parameters
    and covariates onto epifit's model) importable."""
    for p in (str(BENCHMARKS), str(TESTS)):
        if p not in sys.path:
            sys.path.insert(0, p)
    from reference import problem

    return problem


def maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def lower_compile(fn, *args, jit=None):
    """Lower + compile time of `jit(fn)` (default `jax.jit`) at `args`, and the
    executable. epifit's losses use `epifit.jit`, the way epifit compiles them."""
    import jax

    jit = jax.jit if jit is None else jit
    t = time.perf_counter()
    lowered = jit(fn).lower(*args)
    t_lower = time.perf_counter() - t
    t = time.perf_counter()
    compiled = lowered.compile()
    return t_lower + (time.perf_counter() - t), compiled


def median_time(fn, args, repeats: int, budget_s: float = 60.0):
    """Median wall time of `fn(*args)` (after one warm call), block_until_ready."""
    import jax

    t = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t
    n = max(1, min(repeats, int(budget_s / max(first, 1e-9))))
    times = []
    for _ in range(n):
        t = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times), out, n


def interleaved_medians(fns, args, repeats: int, budget_s: float = 60.0):
    """Median wall times of each `fn(*args)` of `fns`, timed in alternation.

    After one warm call each, `fns` run one after another in rounds (at most
    `repeats`, fewer where the warm calls say the rounds would exceed
    `budget_s`), so that a ratio of two medians compares calls made under the
    same machine state: the loss of the reference problem, timed alone, moved
    by 20% from one process to the next (8 against 10 ms) and with it the
    gradient's ratio to it. Returns `(medians, outputs, rounds)`.
    """
    import jax

    outs, first = [], 0.0
    for fn in fns:
        t = time.perf_counter()
        outs.append(jax.block_until_ready(fn(*args)))
        first += time.perf_counter() - t
    n = max(1, min(repeats, int(budget_s / max(first, 1e-9))))
    times = [[] for _ in fns]
    for _ in range(n):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            outs[i] = jax.block_until_ready(fn(*args))
            times[i].append(time.perf_counter() - t)
    return [statistics.median(ts) for ts in times], outs, n


def run_worker(script: Path, argv: list[str], timeout_s: float) -> dict:
    """Run `script --worker ...` in a fresh process and parse its last JSON line."""
    cmd = [sys.executable, str(script), *argv]
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout_s, env=env
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    for line in reversed(proc.stdout.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                break
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
    return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}


def emit(record: dict) -> None:
    """A worker's result: one JSON line on stdout."""
    print(json.dumps(record), flush=True)


def write_json(path: str | None, records: list[dict]) -> None:
    if not path:
        return
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(records, indent=2))
    os.replace(tmp, p)


def add_ratios(group: list[dict], base: dict | None, ratios: dict[str, str]) -> None:
    """`r[name] = r[key] / base[key]` for each `name: key` of `ratios` and each
    record `r` of `group` that has `key` (nothing without a `base`)."""
    if base is None:
        return
    for r in group:
        for name, key in ratios.items():
            if key in r and base.get(key):
                r[name] = r[key] / base[key]


def table(records: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """A plain-text table; `columns` are (key, header, format)."""
    rows = [[h for _, h, _ in columns]]
    for r in records:
        row = []
        for key, _, fmt in columns:
            v = r.get(key)
            row.append("-" if v is None else (fmt.format(v) if fmt else str(v)))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(columns))]
    lines = [
        "  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
