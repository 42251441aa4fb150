"""Calibration benchmark: a full fit of the reference problem, epifit vs diffrax.

One optimiser, written here once, is driven by each tool's loss in its own
process: `optax.lbfgs` (memory 10) with its zoom line search (at most 30
steps, initial step 1), the settings of `epifit.calibrate`'s `lbfgs` phase,
iterated inside `jax.lax.while_loop` in compiled chunks of iterations. The
line search takes `value_and_grad` of the tool's loss, so the gradients come
from

* `epifit`: the reference loss written with epifit (`forward.epifit_loss`:
  Tsit5, PID controller, the default `CheckpointAdjoint`), compiled with
  `epifit.jit`;
* `diffrax-tsit5`: the shared runner's `diffrax-tsit5` peer (`diffeqsolve`
  with Tsit5 and diffrax's default `RecursiveCheckpointAdjoint`), `jax.jit`;

and, as a third worker, `epifit-calibrate`: `epifit.fitting.calibrate` itself
(one `lbfgs` phase) on a `Problem` built from the reference arrays (an xarray
dataset with the covariates, initial state and observations) and
`models/seird_metapop_mobility.toml`, with the same tolerances (made absolute
at the scale of epifit's final loss, as calibrate's are relative to
`max(1, |loss|)`) and at most as many iterations as the `epifit` worker took.
Its compile time is that of a one-iteration fit with a cold persistent
compilation cache; its wall time is the timed fit's `optimize_s`, with the
cache warm (a second run of the same fit), start-up included.

Every fit starts from `p_init` of `make_problem(n, days, 0)` (default 280
patches, 120 days, rtol 1e-3, atol 1e-6, float32) and stops when the relative
loss change stays below `--ftol` for `--patience` iterations in a row, when
`max|grad| <= --gtol * |loss|`, after `--max-iter` iterations, or at its time
cap (checked between chunks): `--time-cap` for diffrax (default 600 s),
`--epifit-time-cap` for epifit. For each worker the table gives compile time,
optimisation wall time (compile excluded), iterations, value-and-gradient
evaluations, final loss, and the wall time to reach the *target* loss: epifit's
final loss, or, when diffrax's capped run stops above it, the best loss
diffrax reached (then, to any loss below that, epifit is at least diffrax's
whole run time over its own time to pass it faster). A second table gives
each worker's time to a few loss levels. Within a chunk, iteration times are
interpolated in proportion to gradient evaluations.

    python benchmarks/calibrate.py --json out/bench_calibrate.json
    python benchmarks/calibrate.py --quick          # 50 patches, 40 days, small caps
    python benchmarks/calibrate.py --report out/bench_calibrate.json   # reprint
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h  # noqa: E402
from forward import _setup, epifit_loss  # noqa: E402

TOOLS = {
    "epifit": ["epifit"],
    "diffrax": ["diffrax-tsit5"],
    "calibrate": ["epifit-calibrate"],
}
CAPACITY = 64  # the most iterations one compiled chunk runs (history buffer)
MEMORY_SIZE = 10
MAX_LINESEARCH_STEPS = 30


# -- the optimiser -----------------------------------------------------------------
def make_lbfgs():
    import optax

    return optax.lbfgs(
        memory_size=MEMORY_SIZE,
        linesearch=optax.scale_by_zoom_linesearch(
            max_linesearch_steps=MAX_LINESEARCH_STEPS, initial_guess_strategy="one"
        ),
    )


def make_chunk(loss, ftol: float, gtol: float, patience: int):
    """`run(carry, rest, n_end) -> (carry, (loss, grad max-norm, evaluations))`:
    L-BFGS iterations of `loss(p, *rest)` until `carry["it"] == n_end` or a stop.

    `carry`: `x, f, g, state, it, flat, status` (0 running, 1 gradient below
    tolerance, 2 loss change below tolerance, 3 non-finite). A line search that
    finds no decrease returns a zero step; the memory then restarts (as
    `epifit.calibrate` does) and the iteration counts as flat.
    """
    import jax
    import jax.numpy as jnp
    import optax

    tx = make_lbfgs()

    def iterate(c, rest):
        value_fn = lambda y: loss(y, *rest)  # noqa: E731
        u, state = tx.update(
            c["g"], c["state"], c["x"], value=c["f"], grad=c["g"], value_fn=value_fn
        )
        info = optax.tree_utils.tree_get(state, "info")
        evals = info.num_linesearch_steps.astype(jnp.int32)
        no_step = jnp.all(u == 0)
        fresh = tx.init(c["x"])
        state = jax.tree.map(lambda a, b: jnp.where(no_step, a, b), fresh, state)
        x = jnp.where(no_step, c["x"], c["x"] + u)
        f = jnp.where(no_step, c["f"], optax.tree_utils.tree_get(state, "value"))
        g = jnp.where(no_step, c["g"], optax.tree_utils.tree_get(state, "grad"))
        finite = jnp.isfinite(f) & jnp.all(jnp.isfinite(g))
        flat = jnp.abs(c["f"] - f) <= ftol * jnp.abs(f)
        n_flat = jnp.where(flat, c["flat"] + 1, 0)
        gmax = jnp.max(jnp.abs(g))
        status = jnp.where(
            ~finite,
            3,
            jnp.where(
                gmax <= gtol * jnp.abs(f), 1, jnp.where(n_flat >= patience, 2, 0)
            ),
        ).astype(jnp.int32)
        new = dict(x=x, f=f, g=g, state=state, it=c["it"] + 1, flat=n_flat)
        new["status"] = status
        return new, (f, gmax, evals)

    def run(c, rest, n_end):
        start = c["it"]
        dt = c["f"].dtype
        buf = (
            jnp.full((CAPACITY,), jnp.nan, dt),
            jnp.full((CAPACITY,), jnp.nan, dt),
            jnp.zeros((CAPACITY,), jnp.int32),
        )

        def cond(s):
            return (s[0]["status"] == 0) & (s[0]["it"] < n_end)

        def body(s):
            c, buf = s
            i = c["it"] - start
            c, rec = iterate(c, rest)
            return c, tuple(b.at[i].set(v) for b, v in zip(buf, rec, strict=True))

        return jax.lax.while_loop(cond, body, (c, buf))

    def init(x, f, g):
        return dict(
            x=x,
            f=f,
            g=g,
            state=tx.init(x),
            it=jnp.zeros((), jnp.int32),
            flat=jnp.zeros((), jnp.int32),
            status=jnp.zeros((), jnp.int32),
        )

    return run, init


STATUS = {
    0: "running",
    1: "gradient below tolerance",
    2: "loss change below tolerance",
    3: "non-finite loss or gradient",
}


def fit(loss, args, a, *, jit, time_cap: float) -> dict:
    """Compile and run the L-BFGS loop on `loss(p, *rest)` from `args[0]`."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    x0, rest = args[0], tuple(args[1:])
    run, init = make_chunk(loss, a.ftol, a.gtol, a.patience)
    vg = jax.value_and_grad(loss)
    rec = {}
    t = time.perf_counter()
    vg_c = jit(lambda x, rest: vg(x, *rest)).lower(x0, rest).compile()
    f0, g0 = jax.block_until_ready(vg_c(x0, rest))
    carry = jax.jit(init)(x0, f0, g0)
    n_end0 = jnp.asarray(1, jnp.int32)
    run_c = jit(run).lower(carry, rest, n_end0).compile()
    rec["compile_s"] = time.perf_counter() - t
    rec["initial_loss"] = float(f0)
    losses, gmaxes, evals, times = [], [], [], []
    n_evals = 1
    t0 = time.perf_counter()
    k = 1
    capped = False
    while True:
        it = int(carry["it"])
        if it >= a.max_iter or int(carry["status"]) != 0:
            break
        n_end = jnp.asarray(min(it + k, a.max_iter), jnp.int32)
        t_chunk = time.perf_counter()
        carry, buf = run_c(carry, rest, n_end)
        buf = [np.asarray(b) for b in jax.block_until_ready(buf)]
        t_end = time.perf_counter()
        done = int(carry["it"]) - it
        e = buf[2][:done].astype(np.float64)
        # an iteration's share of the chunk's time: its gradient evaluations
        w = np.cumsum(e) / max(e.sum(), 1.0)
        times += list((t_chunk - t0) + w * (t_end - t_chunk))
        losses += buf[0][:done].astype(float).tolist()
        gmaxes += buf[1][:done].astype(float).tolist()
        evals += e.astype(int).tolist()
        n_evals += int(e.sum())
        per = (t_end - t_chunk) / max(done, 1)
        k = int(np.clip(a.chunk_seconds / max(per, 1e-6), 1, CAPACITY))
        if t_end - t0 >= time_cap:
            capped = int(carry["status"]) == 0 and int(carry["it"]) < a.max_iter
            break
    rec["wall_s"] = time.perf_counter() - t0
    status = int(carry["status"])
    rec["iterations"] = int(carry["it"])
    rec["evaluations"] = n_evals
    rec["loss"] = float(carry["f"])
    rec["best_loss"] = float(min([rec["initial_loss"], *losses]))
    rec["grad_max"] = float(jnp.max(jnp.abs(carry["g"])))
    rec["capped"] = capped
    rec["status"] = (
        f"time cap {time_cap:g} s"
        if capped
        else STATUS[status]
        if status
        else f"iteration cap {a.max_iter}"
    )
    rec["converged"] = status in (1, 2)
    rec["per_iteration_s"] = rec["wall_s"] / max(rec["iterations"], 1)
    rec["per_evaluation_s"] = rec["wall_s"] / max(n_evals - 1, 1)
    rec["history"] = {"t": times, "loss": losses, "grad_max": gmaxes, "evals": evals}
    return rec


# -- epifit.calibrate on the reference problem -------------------------------------
def reference_dataset(P):
    """The reference arrays as a dataset for `models/seird_metapop_mobility.toml`:
    covariates `(time, patch, ...)`, `initial_*` and the daily observations
    `(time, patch)` (NaN on day 0: no change before the first day)."""
    import numpy as np
    import xarray as xr
    from helpers import reference_covariates, reference_initial_data

    n = P["u0"].shape[1]
    cov = reference_covariates(P)
    data = np.asarray(P["data"], np.float64)
    nan = np.full((1, n), np.nan)
    patches = [f"p{i:04d}" for i in range(n)]
    dv = {
        "mobility": (("time", "patch", "feature"), cov["mobility"]),
        "coupling": (("time", "patch", "patch_to"), cov["coupling"]),
        "new_infections": (("time", "patch"), np.concatenate([nan, data[:, 0]])),
        "new_deaths": (("time", "patch"), np.concatenate([nan, data[:, 1]])),
    }
    for k, v in reference_initial_data(P["u0"]).items():
        dims = ((f"stage_{k.removeprefix('initial_')}",) if v.ndim == 2 else ()) + (
            "patch",
        )
        dv[k] = (dims, v)
    coords = {
        "time": np.arange(P["t_days"].size),
        "patch": patches,
        "patch_to": patches,
    }
    return xr.Dataset(dv, coords=coords)


def calibrate_worker(sm, P, fdt, a, rec) -> dict:
    import jax.numpy as jnp
    import numpy as np
    from helpers import params_from_flat

    from epifit.fitting import calibrate
    from epifit.simulation import Problem

    t = time.perf_counter()
    problem = Problem(
        h.ROOT / "models" / "seird_metapop_mobility.toml",
        reference_dataset(P),
        dtype=a.dtype,
    )
    init = params_from_flat(problem.model, jnp.asarray(P["p_init"], fdt), a.n_patches)
    rec["setup_s"] = time.perf_counter() - t

    def fit(**kw):
        return calibrate(
            problem,
            init=init,
            optimizer=[
                {
                    "method": "lbfgs",
                    "iterations": a.max_iter,
                    "memory_size": MEMORY_SIZE,
                    "max_linesearch_steps": MAX_LINESEARCH_STEPS,
                }
            ],
            rtol=a.rtol,
            atol=a.atol,
            max_steps=4096,
            # calibrate's tolerances are relative to max(1, |loss|); the
            # reference loss is < 1, so the benchmark's relative ones become
            # absolute, at the scale of epifit's final loss (when that worker
            # ran first)
            fit={"patience": a.patience},
            loss_tolerance=a.ftol * a.loss_scale,
            tolerance=a.gtol * a.loss_scale,
            uncertainty=False,
            progress=False,
            **kw,
        )

    # compile: one iteration fills the persistent compilation cache (a fresh
    # directory, enabled by the worker before anything compiled), so that the
    # timed fit below only traces and loads its executables, as a second
    # `epifit calibrate` of the same model does
    t = time.perf_counter()
    fit(max_iterations=1)
    rec["compile_s"] = time.perf_counter() - t
    # the warm start-up of a fit: tracing, loading the executables, the first
    # value-and-gradient, one iteration and the final solve
    r1 = fit(max_iterations=1)
    rec["warm_start_s"] = float(r1.timing["optimize_s"])
    t = time.perf_counter()
    r = fit(time_budget=a.epifit_time_cap)
    total = time.perf_counter() - t
    # the optimiser's time includes the first value-and-gradient and loading
    # the executables from the cache; the rest of `total` is the final solve
    rec["wall_s"] = float(r.timing["optimize_s"])
    rec["total_s"] = total
    rec["iterations"] = int(r.iterations)
    rec["initial_loss"] = float(np.asarray(r.initial_losses)[0])
    rec["loss"] = float(r.loss)
    rec["best_loss"] = float(np.min(r.loss_history)) if r.iterations else r.loss
    rec["converged"] = bool(r.converged)
    rec["status"] = r.message
    rec["capped"] = "time budget" in r.message
    losses = np.asarray(r.loss_history, float)
    # no per-iteration clock inside calibrate: the first iteration ends after
    # the warm start-up, the others share the rest of the time evenly
    t1 = min(rec["warm_start_s"], rec["wall_s"])
    k = np.arange(losses.size)
    times = t1 + (rec["wall_s"] - t1) * k / max(losses.size - 1, 1)
    rec["per_evaluation_s"] = None
    rec["per_iteration_s"] = rec["wall_s"] / max(rec["iterations"], 1)
    rec["history"] = {"t": times.tolist(), "loss": losses.tolist()}
    rec["note"] = (
        "compile_s: a one-iteration calibrate (cold cache); wall_s: calibrate's "
        "optimize_s with a warm persistent cache (warm_start_s of it is start-up); "
        "iteration times spread evenly after the start-up"
    )
    return rec


# -- workers -----------------------------------------------------------------------
def worker(a) -> dict:
    if a.worker == "epifit-calibrate":
        import tempfile

        from epifit import enable_compilation_cache

        cache = enable_compilation_cache(tempfile.mkdtemp(prefix="epifit-bench-cache-"))
    sm = h.require_reference()
    P, fdt = _setup(sm, a.n_patches, a.days, a.dtype)
    import jax
    import jax.numpy as jnp
    import numpy as np

    cfg = a.worker
    rec = {
        "tool": cfg.split("-")[0],
        "config": cfg,
        "dtype": a.dtype,
        "n_patches": a.n_patches,
        "days": a.days,
        "n_params": int(np.asarray(P["p_init"]).size),
    }
    if cfg == "epifit-calibrate":
        import shutil

        try:
            rec = calibrate_worker(sm, P, fdt, a, rec)
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        rec["adjoint"] = "checkpoint"
    elif cfg == "epifit":
        import epifit

        loss, _, args = epifit_loss(sm, P, fdt, a.n_patches, a.rtol, a.atol)
        rec["adjoint"] = "checkpoint"
        jax.block_until_ready(args)
        rec.update(fit(loss, args, a, jit=epifit.jit, time_cap=a.epifit_time_cap))
    else:
        import peers

        ns = types.SimpleNamespace(rtol=a.rtol, atol=a.atol, T=a.days, max_steps=4096)
        mob = jnp.asarray(P["mobility"], fdt)
        cpl = jnp.asarray(P["coupling"], fdt)
        make_vf = lambda count, pytree=False: sm.SEIRD_mobility_coupled  # noqa: E731
        builder, _ = peers.build_peer(cfg, ns, sm, make_vf, jax, jnp, np, mob, cpl)
        loss = builder(count=False)
        args = (
            jnp.asarray(P["p_init"], fdt),
            jnp.asarray(P["u0"], fdt),
            jnp.asarray(P["t_days"], fdt),
            mob,
            cpl,
            jnp.asarray(P["data"], fdt),
        )
        rec["adjoint"] = "recursive-checkpoint"
        jax.block_until_ready(args)
        rec.update(fit(loss, args, a, jit=jax.jit, time_cap=a.time_cap))
    rec["peak_rss_mb"] = round(h.maxrss_mb(), 1)
    return rec


def time_to(rec: dict, target: float, slack: float = 0.0) -> float | None:
    """Optimisation wall time at which `rec`'s loss first reached `target`."""
    if rec.get("initial_loss") is not None and rec["initial_loss"] <= target:
        return 0.0
    hist = rec.get("history") or {}
    bound = target + slack * abs(target)
    for t, f in zip(hist.get("t", []), hist.get("loss", []), strict=False):
        if f <= bound:
            return t
    return None


def compare(records: list[dict], slack: float) -> dict:
    """Targets and speedups of one dtype's group, relative to `epifit`."""
    base = next((r for r in records if r["config"] == "epifit" and "loss" in r), None)
    peer = next(
        (r for r in records if r["config"] == "diffrax-tsit5" and "loss" in r), None
    )
    summary = {}
    if base is None:
        return summary
    target = base["loss"]
    summary["target"] = "epifit's final loss"
    if peer is not None and peer["best_loss"] > target + slack * abs(target):
        # diffrax stopped above epifit's final loss: compare at the best loss
        # it did reach. Below that loss diffrax took longer than its whole run,
        # epifit no longer than it needed to pass it.
        target = peer["best_loss"]
        summary["target"] = "diffrax's best loss (it did not reach epifit's)"
        below = time_to(base, target - slack * abs(target), slack=0.0)
        if peer.get("capped") and below:
            summary["below_target_speedup_at_least"] = peer["wall_s"] / below
    summary["target_loss"] = target
    tb = time_to(base, target, slack)
    for r in records:
        r["target_loss"] = target
        r["time_to_target_s"] = time_to(r, target, slack)
        r.pop("target_time_vs_epifit", None)
        if r["time_to_target_s"] is not None and tb:
            r["target_time_vs_epifit"] = r["time_to_target_s"] / tb
    if peer is not None and peer.get("time_to_target_s") and tb:
        summary["speedup"] = peer["time_to_target_s"] / tb
        summary["speedup_total"] = (peer["time_to_target_s"] + peer["compile_s"]) / (
            tb + base["compile_s"]
        )
    # time to a few loss levels between the start and the target
    f0 = base["initial_loss"]
    levels = sorted(
        (lv for lv in (0.1 * f0, 0.02 * f0, 3 * target) if target < lv < f0),
        reverse=True,
    )
    summary["milestones"] = [
        {
            "loss": lv,
            "times_s": {
                r["config"]: time_to(r, lv, slack if lv == target else 0.0)
                for r in records
                if "loss" in r
            },
        }
        for lv in [*levels, target]
    ]
    return summary


def report(records: list[dict], summaries: dict) -> None:
    """Print the table, the loss milestones and the speedups."""
    print(h.table(records, COLUMNS))
    for dtype, s in summaries.items():
        if not s:
            continue
        rows = []
        for m in s["milestones"]:
            row = {"loss": m["loss"]}
            for cfg, t in m["times_s"].items():
                row[cfg] = t
            base = m["times_s"].get("epifit")
            peer = m["times_s"].get("diffrax-tsit5")
            if base and peer:
                row["ratio"] = peer / base
            rows.append(row)
        cfgs = [r["config"] for r in records if r["dtype"] == dtype and "loss" in r]
        cols = [("loss", f"{dtype}: loss <=", "{:.6g}")]
        cols += [(c, f"{c} s", "{:.1f}") for c in cfgs]
        cols += [("ratio", "diffrax / epifit", "{:.1f}")]
        print()
        print(h.table(rows, cols))
        line = f"\n{dtype}: target {s['target_loss']:.6g} ({s['target']})"
        if "speedup" in s:
            line += (
                f"; epifit reaches it {s['speedup']:.1f}x faster than diffrax "
                f"({s['speedup_total']:.1f}x counting compilation)"
            )
        if "below_target_speedup_at_least" in s:
            line += (
                "; to any loss below it at least "
                f"{s['below_target_speedup_at_least']:.1f}x (diffrax's whole "
                "capped run over epifit's time to pass it)"
            )
        print(line)


COLUMNS = [
    ("config", "config", ""),
    ("dtype", "dtype", ""),
    ("n_patches", "patches", "{}"),
    ("compile_s", "compile s", "{:.1f}"),
    ("wall_s", "wall s", "{:.1f}"),
    ("iterations", "iters", "{}"),
    ("evaluations", "evals", "{}"),
    ("per_iteration_s", "s/iter", "{:.3f}"),
    ("per_evaluation_s", "s/eval", "{:.3f}"),
    ("initial_loss", "initial loss", "{:.6g}"),
    ("loss", "final loss", "{:.6g}"),
    ("time_to_target_s", "t to target s", "{:.1f}"),
    ("target_time_vs_epifit", "x epifit", "{:.1f}"),
    ("capped", "capped", ""),
    ("status", "stopped by", ""),
]


def main(argv=None) -> int:
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
    a = ap.parse_args(argv)
    if a.report:
        saved = json.loads(Path(a.report).read_text())
        records = [r for r in saved if "config" in r]
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
    h.require_reference()
    timeout = a.timeout or max(a.time_cap, a.epifit_time_cap) + 900.0
    records = []
    summaries = {}
    for dtype in a.dtype.split(","):
        configs = [c for t in a.tools.split(",") for c in TOOLS[t.strip()]]
        group = []
        for cfg in configs:
            argv_w = [
                "--worker",
                cfg,
                "--n-patches",
                str(a.n_patches),
                "--days",
                str(a.days),
                "--dtype",
                dtype,
                "--rtol",
                str(a.rtol),
                "--atol",
                str(a.atol),
                "--max-iter",
                str(a.max_iter),
                "--ftol",
                str(a.ftol),
                "--patience",
                str(a.patience),
                "--gtol",
                str(a.gtol),
                "--time-cap",
                str(a.time_cap),
                "--epifit-time-cap",
                str(a.epifit_time_cap),
                "--chunk-seconds",
                str(a.chunk_seconds),
            ]
            if cfg == "epifit-calibrate":
                base = next((r for r in group if r["config"] == "epifit"), {})
                scale = base.get("loss") or base.get("initial_loss") or 1.0
                argv_w += ["--loss-scale", repr(abs(scale))]
                if base.get("iterations"):  # the same number of iterations at most
                    argv_w += ["--max-iter", str(base["iterations"])]
            rec = h.run_worker(Path(__file__), argv_w, timeout)
            for k, v in (
                ("config", cfg),
                ("tool", cfg.split("-")[0]),
                ("dtype", dtype),
                ("n_patches", a.n_patches),
            ):
                rec.setdefault(k, v)
            msg = rec.get("error") or (
                f"{rec['iterations']} iterations in {rec['wall_s']:.1f} s, loss "
                f"{rec['initial_loss']:.6g} -> {rec['loss']:.6g} ({rec['status']})"
            )
            print(f"  {cfg:18s} {dtype} n={a.n_patches}: {msg}", flush=True)
            group.append(rec)
        summaries[dtype] = compare(group, a.slack)
        records += group
    print()
    report(records, summaries)
    h.write_json(a.json, records + [{"summary": summaries, "settings": vars(a)}])
    return 0


if __name__ == "__main__":
    sys.exit(main())
