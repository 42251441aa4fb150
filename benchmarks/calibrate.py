"""Calibration benchmark: a full fit of the reference problem, epifit vs diffrax.

One optimiser (`benchmarks/_lbfgs.py`: `epifit.calibrate`'s own L-BFGS step
function, memory 10, Armijo backtracking of at most 30 trials, one
`value_and_grad` per loop trip, with epifit's treatment of non-finite
values) is driven by each tool's loss in its own process. It evaluates
`value_and_grad` of

* `epifit`: the reference loss written with epifit (`forward.epifit_loss`:
  Tsit5, PID controller, the default `CheckpointAdjoint`), compiled with
  `epifit.jit`;
* `diffrax-tsit5`: the `diffrax-tsit5` peer of `benchmarks/reference/peers.py`
  (`diffeqsolve` with Tsit5 and diffrax's default
  `RecursiveCheckpointAdjoint`), `jax.jit`;

and, as a third worker, `epifit-calibrate`: `epifit.fitting.calibrate`
itself (`benchmarks/_calibrate_epifit.py`), with the same tolerances and at
most as many iterations as the `epifit` worker took.

Both losses solve with `throw=False`, as `epifit.fitting.Objective` does: a
solve that fails at a trial point (diffrax's `max_steps`, `--peer-max-steps`,
default 4096 for the whole solve; epifit's 4096 per day) gives a NaN loss,
a retreat: the iterate stays, the step is halved (`rejected_steps`). A
worker that fails (a non-finite loss at the start, an exception, a crash or
a timeout) is reported with its reason in the table and the JSON (`error`),
and the others are still compared.

Every fit starts from `p_init` of `make_problem(n, days, 0)` (default 280
patches, 120 days, rtol 1e-3, atol 1e-6, float32) and stops when the relative
loss change stays below `--ftol` for `--patience` iterations in a row, when
`max|grad| <= --gtol * |loss|`, after `--max-iter` iterations, or at its time
cap (checked between chunks): `--time-cap` for diffrax (default 600 s),
`--epifit-time-cap` for epifit. Each JSON record carries `config`,
`n_patches`, `compile_s` (the whole fit's compilation), `grad_compile_s` (one
`value_and_grad` of the same objective, compiled in the same worker),
`wall_s` (the optimisation, from the first evaluation), `final_loss`,
`time_to_target_s` (optimisation time to the *target* loss) and
`time_to_result_s` (`compile_s + wall_s`: the time to a result from a cold
start). The target is epifit's final loss, or, when diffrax's capped run
stops above it, the best loss diffrax reached (then, to any loss below that,
epifit is at least diffrax's whole run time over its own time to pass it
faster). A second table gives each worker's time to a few loss levels.
Within a chunk, iteration times are interpolated in proportion to gradient
evaluations.

    python benchmarks/calibrate.py --json out/bench_calibrate.json
    python benchmarks/calibrate.py --quick          # 50 patches, 40 days, small caps
    python benchmarks/calibrate.py --report out/bench_calibrate.json   # reprint
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h  # noqa: E402
from _lbfgs import fit, time_to  # noqa: E402
from forward import _setup, epifit_loss  # noqa: E402

TOOLS = {
    "epifit": ["epifit"],
    "diffrax": ["diffrax-tsit5"],
    "calibrate": ["epifit-calibrate"],
}
# every record has these (None where a failed worker did not measure them)
FIELDS = (
    "config",
    "n_patches",
    "compile_s",
    "grad_compile_s",
    "wall_s",
    "final_loss",
    "time_to_target_s",
    "time_to_result_s",
)


# -- workers -----------------------------------------------------------------------
def _peer_fit(P, fdt, a, rec) -> dict:
    import jax
    import jax.numpy as jnp
    from reference import peers

    mob = jnp.asarray(P["mobility"], fdt)
    cpl = jnp.asarray(P["coupling"], fdt)
    loss, solve = peers.build(
        a.worker,
        mob,
        cpl,
        rtol=a.rtol,
        atol=a.atol,
        max_steps=a.peer_max_steps,
        throw=False,
    )
    args = peers.arguments(P, fdt)
    rec["adjoint"] = peers.PEERS[a.worker].adjoint
    rec["max_steps"] = a.peer_max_steps

    def diagnose(x):
        return peers.failure(jax.jit(solve)(x, *args[1:5]))

    jax.block_until_ready(args)
    return fit(loss, args, a, jit=jax.jit, time_cap=a.time_cap, diagnose=diagnose)


def _run_worker(a, rec) -> dict:
    import jax

    sm = h.reference_problem()
    P, fdt = _setup(sm, a.n_patches, a.days, a.dtype)
    rec["n_params"] = int(P["p_init"].size)
    if a.worker == "epifit-calibrate":
        from _calibrate_epifit import calibrate_worker

        rec["adjoint"] = "checkpoint"
        return calibrate_worker(P, fdt, a, rec)
    if a.worker == "epifit":
        import epifit

        rec["adjoint"] = "checkpoint"
        loss, _, args = epifit_loss(
            sm, P, fdt, a.n_patches, a.rtol, a.atol, throw=False
        )
        jax.block_until_ready(args)
        rec.update(fit(loss, args, a, jit=epifit.jit, time_cap=a.epifit_time_cap))
        return rec
    rec.update(_peer_fit(P, fdt, a, rec))
    return rec


def worker(a) -> dict:
    """One configuration's record; an exception becomes its `error`."""
    import shutil
    import tempfile

    cache = None
    if a.worker == "epifit-calibrate":
        # a fresh persistent compilation cache, before anything compiles
        from epifit import enable_compilation_cache

        cache = enable_compilation_cache(tempfile.mkdtemp(prefix="epifit-bench-"))
    rec = {"tool": a.worker.split("-")[0], "config": a.worker, "dtype": a.dtype}
    rec.update(n_patches=a.n_patches, days=a.days)
    try:
        rec = _run_worker(a, rec)
    except Exception as e:  # reported, so that the other tools still compare
        lines = str(e).strip().splitlines() or [""]
        rec["error"] = f"{type(e).__name__}: {lines[0][:300]}"
        rec["status"] = f"failed: {rec['error']}"
    finally:
        if cache is not None:
            shutil.rmtree(cache, ignore_errors=True)
    rec["peak_rss_mb"] = round(h.maxrss_mb(), 1)
    return rec


# -- comparison ----------------------------------------------------------------------
def _ok(r: dict) -> bool:
    return r.get("final_loss") is not None and not r.get("error")


def compare(records: list[dict], slack: float) -> dict:
    """Targets and speedups of one dtype's group, relative to `epifit` (or,
    when epifit failed, to the first worker that did not)."""
    ok = [r for r in records if _ok(r)]
    summary = {"failed": {r["config"]: r.get("error") for r in records if not _ok(r)}}
    for r in records:
        r["time_to_target_s"] = None
        r.pop("target_time_vs_epifit", None)
        # cold compilation plus the fit: the time to a result (none if failed)
        r["time_to_result_s"] = r["compile_s"] + r["wall_s"] if _ok(r) else None
    base = next((r for r in ok if r["config"] == "epifit"), ok[0] if ok else None)
    if base is None:
        return summary
    peer = next((r for r in ok if r["config"] == "diffrax-tsit5"), None)
    target = base["final_loss"]
    summary["target"] = f"{base['config']}'s final loss"
    if peer is not None and peer["best_loss"] > target + slack * abs(target):
        # diffrax stopped above the base's final loss: compare at the best
        # loss it did reach. Below that loss diffrax took longer than its
        # whole run, the base no longer than it needed to pass it.
        target = peer["best_loss"]
        summary["target"] = f"diffrax's best loss (it did not reach {base['config']}'s)"
        below = time_to(base, target - slack * abs(target))
        if peer.get("capped") and below:
            summary["below_target_speedup_at_least"] = peer["wall_s"] / below
    summary["target_loss"] = target
    tb = time_to(base, target, slack)
    for r in ok:
        r["target_loss"] = target
        r["time_to_target_s"] = time_to(r, target, slack)
        if r["time_to_target_s"] is not None and tb and base["config"] == "epifit":
            r["target_time_vs_epifit"] = r["time_to_target_s"] / tb
    if peer is not None and peer["time_to_target_s"] and tb and peer is not base:
        summary["speedup"] = peer["time_to_target_s"] / tb
        summary["speedup_total"] = (peer["time_to_target_s"] + peer["compile_s"]) / (
            tb + base["compile_s"]
        )
    summary["milestones"] = _milestones(ok, base["initial_loss"], target, slack)
    return summary


def _milestones(records, f0, target, slack) -> list[dict]:
    """Each worker's time to a few loss levels between the start and the target."""
    levels = [lv for lv in (0.1 * f0, 0.02 * f0, 3 * target) if target < lv < f0]
    return [
        {
            "loss": lv,
            "times_s": {
                r["config"]: time_to(r, lv, slack if lv == target else 0.0)
                for r in records
            },
        }
        for lv in [*sorted(levels, reverse=True), target]
    ]


COLUMNS = [
    ("config", "config", ""),
    ("dtype", "dtype", ""),
    ("n_patches", "patches", "{}"),
    ("compile_s", "compile s", "{:.1f}"),
    ("grad_compile_s", "grad comp s", "{:.1f}"),
    ("chunk_compile_s", "chunk comp s", "{:.1f}"),
    ("chunk_vs_grad", "chunk/grad", "{:.2f}"),
    ("wall_s", "wall s", "{:.1f}"),
    ("time_to_result_s", "result s", "{:.1f}"),
    ("iterations", "iters", "{}"),
    ("evaluations", "evals", "{}"),
    ("rejected_steps", "rejected", "{}"),
    ("per_evaluation_s", "s/eval", "{:.3f}"),
    ("initial_loss", "initial loss", "{:.6g}"),
    ("final_loss", "final loss", "{:.6g}"),
    ("time_to_target_s", "t to target s", "{:.1f}"),
    ("target_time_vs_epifit", "x epifit", "{:.1f}"),
    ("short_status", "stopped by", ""),
]


def report(records: list[dict], summaries: dict) -> None:
    """Print the table, the failures, the loss milestones and the speedups."""
    for r in records:
        status = str(r.get("status") or r.get("error") or "")
        r["short_status"] = status if len(status) <= 48 else status[:45] + "..."
    print(h.table(records, COLUMNS))
    for r in records:
        r.pop("short_status")
    for r in records:
        if r.get("chunk_vs_grad") is not None:
            print(
                f"\n{r['config']} {r['dtype']} n={r['n_patches']}: calibrate's chunk "
                f"compiles in {r['chunk_compile_s']:.2f} s = {r['chunk_vs_grad']:.2f}x "
                f"one value_and_grad ({r['grad_compile_s']:.2f} s; target <= 1.5x); "
                f"the cold one-iteration fit (compile_s, every program and the "
                f"start-up) {r['compile_s']:.2f} s = "
                f"{r['compile_s'] / r['grad_compile_s']:.2f}x"
            )
    for dtype, s in summaries.items():
        for cfg, why in s.get("failed", {}).items():
            print(f"\n{dtype}: {cfg} FAILED: {why}")
        if "milestones" not in s:
            continue
        rows = []
        for m in s["milestones"]:
            row = {"loss": m["loss"], **m["times_s"]}
            base, peer = m["times_s"].get("epifit"), m["times_s"].get("diffrax-tsit5")
            if base and peer:
                row["ratio"] = peer / base
            rows.append(row)
        cols = [("loss", f"{dtype}: loss <=", "{:.6g}")]
        cols += [(c, f"{c} s", "{:.1f}") for c in s["milestones"][0]["times_s"]]
        cols += [("ratio", "diffrax / epifit", "{:.1f}")]
        print()
        print(h.table(rows, cols))
        line = f"\n{dtype}: target {s['target_loss']:.6g} ({s['target']})"
        if "speedup" in s:
            line += (
                f"; diffrax's time to it over epifit's: {s['speedup']:.1f}x "
                f"({s['speedup_total']:.1f}x counting compilation)"
            )
        if "below_target_speedup_at_least" in s:
            line += (
                "; to any loss below it at least "
                f"{s['below_target_speedup_at_least']:.1f}x (diffrax's whole "
                "capped run over epifit's time to pass it)"
            )
        print(line)


# -- the driver ----------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-patches", type=int, default=280)
    ap.add_argument("--days", type=int, default=120)
    ap.add_argument("--dtype", default="float32", help="float32 and/or float64")
    ap.add_argument("--tools", default="epifit,diffrax,calibrate")
    ap.add_argument("--rtol", type=float, default=1e-3)
    ap.add_argument("--atol", type=float, default=1e-6)
    ap.add_argument("--max-iter", type=int, default=2000)
    ap.add_argument(
        "--ftol",
        type=float,
        default=1e-6,
        help="stop when |loss change| <= ftol * |loss| for --patience iterations",
    )
    ap.add_argument("--patience", type=int, default=10)
    ap.add_argument(
        "--gtol", type=float, default=1e-7, help="stop when max|grad| <= gtol*|loss|"
    )
    ap.add_argument(
        "--peer-max-steps",
        type=int,
        default=4096,
        help="diffrax's max_steps for the whole solve (a solve that needs more "
        "fails: a NaN loss)",
    )
    ap.add_argument(
        "--time-cap", type=float, default=600.0, help="diffrax's time cap, s"
    )
    ap.add_argument(
        "--epifit-time-cap",
        type=float,
        default=900.0,
        help="epifit's (and epifit-calibrate's) time cap, s",
    )
    ap.add_argument(
        "--chunk-seconds", type=float, default=1.0, help="target seconds per chunk"
    )
    ap.add_argument(
        "--slack",
        type=float,
        default=1e-4,
        help="a loss within this relative distance of the target reaches it",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a smoke test: by default 50 patches, 40 days, 200 iterations, 60 s caps",
    )
    ap.add_argument("--timeout", type=float, default=None, help="per worker, s")
    ap.add_argument("--loss-scale", type=float, default=1.0, help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--report", default=None, help="print the results of an earlier --json run"
    )
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    if "--quick" in (sys.argv[1:] if argv is None else argv):
        # a smoke test's defaults; options given explicitly still win
        ap.set_defaults(
            n_patches=50, days=40, max_iter=200, time_cap=60.0, epifit_time_cap=60.0
        )
    return ap.parse_args(argv)


WORKER_OPTIONS = (
    "n_patches",
    "days",
    "rtol",
    "atol",
    "max_iter",
    "ftol",
    "patience",
    "gtol",
    "peer_max_steps",
    "time_cap",
    "epifit_time_cap",
    "chunk_seconds",
)


def run_config(a, cfg: str, dtype: str, group: list[dict], timeout: float) -> dict:
    """Run one configuration's worker; its record, the required fields filled."""
    argv = ["--worker", cfg, "--dtype", dtype]
    for k in WORKER_OPTIONS:
        argv += [f"--{k.replace('_', '-')}", str(getattr(a, k))]
    if cfg == "epifit-calibrate":
        base = next((r for r in group if r["config"] == "epifit"), {})
        scale = base.get("final_loss") or base.get("initial_loss") or 1.0
        argv += ["--loss-scale", repr(abs(scale))]
        if base.get("iterations"):  # the same number of iterations at most
            argv += ["--max-iter", str(base["iterations"])]
    rec = h.run_worker(Path(__file__), argv, timeout)
    if "error" in rec:
        rec.setdefault("status", f"failed: {rec['error']}")
    defaults = {"config": cfg, "tool": cfg.split("-")[0], "dtype": dtype}
    defaults["n_patches"] = a.n_patches
    for k in FIELDS:
        rec.setdefault(k, defaults.get(k))
    for k, v in defaults.items():
        rec.setdefault(k, v)
    msg = (
        f"FAILED: {rec['error']}"
        if rec.get("error")
        else (
            f"{rec['iterations']} iterations in {rec['wall_s']:.1f} s, loss "
            f"{rec['initial_loss']:.6g} -> {rec['final_loss']:.6g} ({rec['status']})"
        )
    )
    print(f"  {cfg:18s} {dtype} n={a.n_patches}: {msg}", flush=True)
    return rec


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.report:
        saved = json.loads(Path(a.report).read_text())
        records = [r for r in saved if "config" in r]
        for r in records:  # records written before `loss` became `final_loss`
            if "final_loss" not in r and "loss" in r:
                r["final_loss"] = r.pop("loss")
        settings = next((r["settings"] for r in saved if "settings" in r), {})
        slack = settings.get("slack", a.slack)
        dtypes = dict.fromkeys(r["dtype"] for r in records)
        summaries = {
            d: compare([r for r in records if r["dtype"] == d], slack) for d in dtypes
        }
        report(records, summaries)
        return 0
    if a.worker:
        h.emit(worker(a))
        return 0
    timeout = a.timeout or max(a.time_cap, a.epifit_time_cap) + 900.0
    records, summaries = [], {}
    for dtype in a.dtype.split(","):
        group = []
        for cfg in [c for t in a.tools.split(",") for c in TOOLS[t.strip()]]:
            group.append(run_config(a, cfg, dtype, group, timeout))
        summaries[dtype] = compare(group, a.slack)
        records += group
    print()
    report(records, summaries)
    h.write_json(a.json, records + [{"summary": summaries, "settings": vars(a)}])
    return 0


if __name__ == "__main__":
    sys.exit(main())
