"""Gradient benchmark: `value_and_grad` of the reference loss, epifit vs peers.

For every epifit adjoint and, in the same run, diffrax (Tsit5 with
RecursiveCheckpointAdjoint, BacksolveAdjoint, and the pytree `scan_kind="bounded"`
variant) and `jax.experimental.ode.odeint` (covariates as its arguments, as
reported, and closed over), each in its own process: forward compile and
evaluation, `value_and_grad` lower + compile and evaluation, peak RSS, and the
relative gradient error against a tight float64 reference (diffrax Tsit5,
rtol 1e-8, atol 1e-12, steps stopped at the half-day jumps of the day index:
the `reference` configuration of `benchmarks/reference/peers.py`, computed
once in its own worker and cached in `out/`).

    python benchmarks/gradient.py --dtype float32 --json out/gradient.json
    python benchmarks/gradient.py --scaling 50,100,280,500,1000,2000 --tools epifit
    python benchmarks/gradient.py --dtype float32 --rounds 3 --ref-max-patches 0

Gradients are taken with respect to the reference's flat parameter vector at
its perturbed start `p_init`, with `jax.value_and_grad` for every reverse
adjoint; the forward entry is `epifit.ode.jacobian` of the loss (one tangent
per parameter; `grad_method` says which). The reference gradient is computed
up to `--ref-max-patches` (default 280) patches; above, `grad_rel_err` is left
out and the run says so.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h  # noqa: E402
from forward import _setup, epifit_loss  # noqa: E402

EPIFIT_ADJOINTS = ["checkpoint", "backsolve", "interpolating", "quadrature", "forward"]
TOOLS = {
    # every adjoint with Tsit5 (the peers' solver), and the default adjoint with
    # Bosh3 (see benchmarks/forward.py; its grad_rel_err is reported beside it)
    "epifit": [f"epifit-{a}" for a in EPIFIT_ADJOINTS] + ["epifit-bosh3"],
    "diffrax": [
        "diffrax-tsit5",
        "diffrax-tsit5-backsolve",
        "diffrax-tsit5-pytree-bounded",
    ],
    "odeint": ["odeint", "odeint-closure"],
}


def _adjoint(name):
    from epifit.ode import (
        BacksolveAdjoint,
        CheckpointAdjoint,
        ForwardAdjoint,
        InterpolatingAdjoint,
        QuadratureAdjoint,
    )

    return {
        "checkpoint": CheckpointAdjoint(),
        "backsolve": BacksolveAdjoint(),
        "interpolating": InterpolatingAdjoint(),
        "quadrature": QuadratureAdjoint(),
        "forward": ForwardAdjoint(),
    }[name]


def worker(a) -> dict:
    sm = h.reference_problem()
    if a.worker == "reference":
        return reference_worker(sm, a)
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
    }
    if cfg.startswith("epifit"):
        import epifit
        from epifit.ode import Bosh3, Tsit5

        bosh3 = cfg == "epifit-bosh3"
        name = "checkpoint" if bosh3 else cfg.split("-", 1)[1]
        rec["adjoint"] = name
        rec["solver"] = "bosh3" if bosh3 else "tsit5"
        rec["default"] = name == "checkpoint" and not bosh3
        loss, _, args = epifit_loss(
            sm,
            P,
            fdt,
            a.n_patches,
            a.rtol,
            a.atol,
            adjoint=_adjoint(name),
            solver=Bosh3() if bosh3 else Tsit5(),
        )
        jit = epifit.jit
        if name == "forward":
            # Forward sensitivities as a user should take them here: the
            # Jacobian of the scalar loss in the flat parameters, one tangent
            # per parameter (epifit.ode.jacobian runs the solves forward).
            # `jax.value_and_grad` with ForwardAdjoint would solve one tangent
            # per element of the solve's differentiated inputs instead, here
            # the 120 x 280 per-day transmission rates the MLP computes: it
            # had not finished after 20 minutes (5.6 GB RSS) when stopped.
            jac = epifit.ode.jacobian(loss)
            vg = lambda *xs: (loss(*xs), jac(*xs))  # noqa: E731
            rec["grad_method"] = "jacfwd"
        else:
            vg = jax.value_and_grad(loss)
            rec["grad_method"] = "value_and_grad"
    else:
        from reference import peers

        jit = jax.jit
        peer = peers.PEERS[cfg]
        rec["adjoint"] = peer.adjoint
        rec["solver"] = peer.solver
        rec["default"] = False  # `default` marks epifit's default adjoint
        rec["peer_default"] = cfg in ("diffrax-tsit5", "odeint")
        mob = jnp.asarray(P["mobility"], fdt)
        cpl = jnp.asarray(P["coupling"], fdt)
        loss = peers.build(cfg, mob, cpl, rtol=a.rtol, atol=a.atol).loss
        args = peers.arguments(P, fdt)
        vg = jax.value_and_grad(loss)
    jax.block_until_ready(args)
    rec["base_rss_mb"] = round(h.maxrss_mb(), 1)
    rec["fwd_compile_s"], cf = h.lower_compile(loss, *args, jit=jit)
    rec["grad_compile_s"], cg = h.lower_compile(vg, *args, jit=jit)
    # the loss and the gradient timed in alternation: grad/fwd compares calls
    # made under the same machine state
    times, (val, (v, g)), rec["repeats"] = h.interleaved_medians(
        (cf, cg), args, a.repeats, budget_s=a.budget
    )
    rec["fwd_s"], rec["grad_s"] = times
    rec["loss"] = float(val)
    rec["grad_over_fwd"] = rec["grad_s"] / rec["fwd_s"]
    rec["peak_rss_mb"] = round(h.maxrss_mb(), 1)
    g = np.asarray(g, np.float64)
    rec["grad_norm"] = float(np.linalg.norm(g))
    if a.ref and Path(a.ref).exists():
        ref = np.load(a.ref)
        gref = np.asarray(ref["grad"], np.float64)
        rec["grad_rel_err"] = float(np.linalg.norm(g - gref) / np.linalg.norm(gref))
        rec["loss_rel_err"] = abs(float(v) - float(ref["loss"])) / abs(
            float(ref["loss"])
        )
    return rec


def reference_worker(sm, a) -> dict:
    """The `reference` configuration's float64 loss and gradient at `p_init`,
    written to `--write-ref` (`.npz`: loss, grad, n_c, T, seed, rtol, atol)."""
    P, fdt = _setup(sm, a.n_patches, a.days, "float64")
    import jax
    import numpy as np
    from reference import peers

    peer = peers.PEERS["reference"]
    args = peers.arguments(P, fdt)
    loss = peers.build("reference", args[3], args[4]).loss
    t = time.perf_counter()
    v, g = jax.block_until_ready(jax.jit(jax.value_and_grad(loss))(*args))
    out = Path(a.write_ref)
    tmp = out.with_name(out.stem + ".tmp.npz")
    np.savez(
        tmp,
        loss=np.float64(v),
        grad=np.asarray(g, np.float64),
        n_c=a.n_patches,
        T=a.days,
        seed=0,
        rtol=peer.rtol,
        atol=peer.atol,
    )
    os.replace(tmp, out)
    return {"config": "reference", "loss": float(v), "wall_s": time.perf_counter() - t}


def reference_file(n: int, days: int, timeout: float, ref_dir: str) -> Path | None:
    """The tight float64 reference gradient (the `reference` peer), computed in
    its own worker and cached in `ref_dir` (`--ref-dir`)."""
    out = Path(ref_dir) / f"gradient_ref_{n}_{days}.npz"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    argv = ["--worker", "reference", "--n-patches", str(n), "--days", str(days)]
    argv += ["--write-ref", str(out)]
    print(f"computing the float64 reference gradient ({n} patches) ...", flush=True)
    rec = h.run_worker(Path(__file__), argv, timeout)
    if not out.exists():
        print(
            f"  no reference gradient ({rec.get('error', 'no file written')});"
            " grad_rel_err is left out",
            flush=True,
        )
        return None
    return out


COLUMNS = [
    ("config", "config", ""),
    ("dtype", "dtype", ""),
    ("n_patches", "patches", "{}"),
    ("fwd_compile_s", "fwd comp s", "{:.2f}"),
    ("fwd_s", "fwd s", "{:.4f}"),
    ("grad_compile_s", "grad comp s", "{:.2f}"),
    ("grad_s", "grad s", "{:.4f}"),
    ("grad_over_fwd", "grad/fwd", "{:.2f}"),
    ("fwd_vs_epifit", "fwd x epifit", "{:.1f}"),
    ("grad_vs_epifit", "grad x epifit", "{:.1f}"),
    ("grad_vs_epifit_bosh3", "grad x bosh3", "{:.1f}"),
    ("peak_rss_mb", "peak RSS MB", "{:.0f}"),
    ("grad_rel_err", "grad rel err", "{:.2e}"),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-patches", type=int, default=280)
    ap.add_argument("--days", type=int, default=120)
    ap.add_argument("--dtype", default="float32,float64")
    ap.add_argument("--tools", default="epifit,diffrax,odeint")
    ap.add_argument(
        "--adjoints", default=",".join(EPIFIT_ADJOINTS), help="epifit adjoints to run"
    )
    ap.add_argument("--rtol", type=float, default=1e-3)
    ap.add_argument("--atol", type=float, default=1e-6)
    ap.add_argument(
        "--repeats",
        type=int,
        default=21,
        help="rounds of the loss and gradient timed in alternation (median)",
    )
    ap.add_argument(
        "--budget",
        type=float,
        default=60.0,
        help="seconds of timed loss and gradient rounds per config",
    )
    ap.add_argument("--timeout", type=float, default=1500.0, help="per worker, s")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every configuration this many times, in turn (a process "
        "each), and print the medians: the ratios are taken within each round, "
        "so a machine whose speed drifts over minutes compares like with like",
    )
    ap.add_argument(
        "--scaling",
        default=None,
        help="comma-separated patch counts: run a scaling sweep",
    )
    ap.add_argument(
        "--skip",
        default="",
        help="comma-separated configs not to run (e.g. the slow covariates-as-"
        "arguments peers: diffrax-tsit5-backsolve,odeint)",
    )
    ap.add_argument(
        "--ref-max-patches",
        type=int,
        default=280,
        help="compute the float64 reference gradient (for grad_rel_err) only up to "
        "this many patches: it is a tight diffrax solve, minutes at 280 patches",
    )
    ap.add_argument(
        "--ref-dir",
        default=str(h.ROOT / "out"),
        help="where the reference gradients are cached (default: out/, where "
        "benchmarks/forward.py looks for them)",
    )
    ap.add_argument("--json", default=None)
    ap.add_argument("--ref", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--write-ref", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        h.emit(worker(a))
        return 0
    sizes = [int(x) for x in a.scaling.split(",")] if a.scaling else [a.n_patches]
    adjoints = set(a.adjoints.split(","))
    records = []
    for n in sizes:
        if n <= a.ref_max_patches:
            ref = reference_file(n, a.days, a.timeout, a.ref_dir)
        else:
            ref = None
            print(
                f"{n} patches: above --ref-max-patches {a.ref_max_patches}, no "
                "reference gradient; grad_rel_err is left out",
                flush=True,
            )
        for dtype in a.dtype.split(","):
            configs = [
                c
                for t in a.tools.split(",")
                for c in TOOLS[t.strip()]
                if not c.startswith("epifit-")
                or c.split("-", 1)[1] in adjoints
                or (c == "epifit-bosh3" and "checkpoint" in adjoints)
                if c not in a.skip.split(",")
            ]
            for r in range(a.rounds):
                group = [_run_config(a, cfg, n, dtype, ref, r) for cfg in configs]
                _add_ratios(group)
                records += group
    print()
    print(
        h.table(records, COLUMNS + ([("round", "round", "{}")] if a.rounds > 1 else []))
    )
    if a.rounds > 1:
        print()
        print(f"median over {a.rounds} rounds (ratios taken within each round):")
        print(h.table(_medians(records), SUMMARY))
    h.write_json(a.json, records)
    return 0


def _run_config(a, cfg, n, dtype, ref, rnd) -> dict:
    """One configuration's worker (its own process), and its line."""
    argv_w = ["--worker", cfg, "--n-patches", str(n), "--days", str(a.days)]
    argv_w += ["--dtype", dtype, "--rtol", str(a.rtol), "--atol", str(a.atol)]
    argv_w += ["--repeats", str(a.repeats), "--budget", str(a.budget)]
    if ref:
        argv_w += ["--ref", str(ref)]
    rec = h.run_worker(Path(__file__), argv_w, a.timeout)
    for k, v in (
        ("config", cfg),
        ("tool", cfg.split("-")[0]),
        ("dtype", dtype),
        ("n_patches", n),
        ("round", rnd),
    ):
        rec.setdefault(k, v)
    msg = rec.get("error") or (
        f"grad compile {rec['grad_compile_s']:.2f} s, grad "
        f"{rec['grad_s'] * 1e3:.1f} ms ({rec['grad_over_fwd']:.2f}x loss)"
    )
    print(f"  {cfg:32s} {dtype} n={n}: {msg}", flush=True)
    return rec


def _add_ratios(group: list[dict]) -> None:
    """Each record's gradient time over epifit's default's and Bosh3's, in
    the same round."""
    base = next(
        (
            r
            for r in group
            if r.get("default") and r["tool"] == "epifit" and "grad_s" in r
        ),
        None,
    )
    bosh = next(
        (r for r in group if r["config"] == "epifit-bosh3" and "grad_s" in r), None
    )
    h.add_ratios(group, base, {"grad_vs_epifit": "grad_s", "fwd_vs_epifit": "fwd_s"})
    h.add_ratios(group, bosh, {"grad_vs_epifit_bosh3": "grad_s"})


_SUMMARY_KEYS = ["config", "dtype", "n_patches", "rounds", "fwd_compile_s", "fwd_s"]
_SUMMARY_KEYS += ["grad_compile_s", "grad_s", "grad_over_fwd", "fwd_vs_epifit"]
_SUMMARY_KEYS += ["grad_vs_epifit", "grad_vs_epifit_range"]
_EXTRA = [
    ("rounds", "rounds", "{}"),
    ("grad_vs_epifit_range", "grad x epifit range", ""),
]
SUMMARY = [c for k in _SUMMARY_KEYS for c in COLUMNS + _EXTRA if c[0] == k]


def _medians(records: list[dict]) -> list[dict]:
    """Per (config, dtype, patches): the median of each timing and of each
    within-round ratio over the rounds, and the ratio's range."""
    import numpy as np

    out = {}
    for r in records:
        if "grad_s" in r:
            out.setdefault((r["config"], r["dtype"], r["n_patches"]), []).append(r)
    rows = []
    for (cfg, dtype, n), rs in out.items():
        row = {"config": cfg, "dtype": dtype, "n_patches": n, "rounds": len(rs)}
        for k, *_ in SUMMARY[4:-1]:
            vals = [r[k] for r in rs if k in r]
            if vals:
                row[k] = float(np.median(vals))
        ratios = [r["grad_vs_epifit"] for r in rs if "grad_vs_epifit" in r]
        if ratios:
            row["grad_vs_epifit_range"] = f"{min(ratios):.1f}-{max(ratios):.1f}"
        rows.append(row)
    return rows


if __name__ == "__main__":
    sys.exit(main())
