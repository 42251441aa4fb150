"""Forward benchmark: the reference loss (solve + loss) for epifit and its peers.

On the reference problem of `benchmarks/reference/problem.py` (default 280
patches, 120 days, rtol 1e-3, atol 1e-6, at the perturbed start `p_init`) this
measures, for each tool in its own process: lower + compile time of the jitted
loss, the median evaluation time, peak RSS, the bare runtime's RSS (JAX
imported and the inputs on the device, nothing compiled) and the solver steps.
The peers' losses are built by `reference.peers.build`
(`benchmarks/reference/peers.py`): the configurations epifit is measured
against.

    python benchmarks/forward.py --dtype float32 --json out/forward.json

epifit runs twice: with Tsit5, the peers' solver, and with Bosh3, a lower-order
pair that suffices when the inputs' half-day jumps, not the tolerance, bound
every step; each record's `loss_rel_err` (against the float64 reference loss
that `benchmarks/gradient.py` computes and caches in `out/`, when present)
shows what the cheaper solver costs in accuracy.

Prints a table with ratios to epifit (Tsit5) and to epifit-bosh3, and writes
the records as JSON.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h  # noqa: E402

TOOLS = {
    # epifit with Tsit5, like for like with the peers, and with Bosh3: a
    # third-order pair, enough where the half-day jumps of the inputs bound
    # every step (its error against the reference is reported beside it)
    "epifit": ["epifit", "epifit-bosh3"],
    "diffrax": ["diffrax-tsit5", "diffrax-tsit5-pytree-bounded"],
    "odeint": ["odeint", "odeint-closure"],
}


def _setup(sm, n, days, dtype):
    import jax

    if dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp

    fdt = jnp.float64 if dtype == "float64" else jnp.float32
    P = sm.make_problem(n, days, 0)
    return P, fdt


def epifit_loss(sm, P, fdt, n, rtol, atol, adjoint=None, solver=None, throw=True):
    """The reference loss written with epifit: args (p_flat, init, covariates, data).

    `solver` defaults to Tsit5 (the peers' solver). `throw=False`: a failed
    solve gives a NaN loss (its states after the failure are NaN), as in
    `epifit.fitting.Objective`."""
    import jax.numpy as jnp
    import numpy as np
    from helpers import params_from_flat, reference_covariates, reference_initial_data

    import epifit.model as em
    from epifit.ode import PIDController, Tsit5, solve

    solver = Tsit5() if solver is None else solver

    model = em.compile_model(
        em.load_model(h.ROOT / "models" / "seird_metapop_mobility.toml")
    )
    cov = {k: jnp.asarray(v, fdt) for k, v in reference_covariates(P).items()}
    # epifit stores mobility matrices by rows when they are sparse (as Problem
    # does when it binds a dataset): data preparation, like the day-major layout.
    cov["coupling"] = em.sparse_coupling(np.asarray(cov["coupling"]))
    init = {k: jnp.asarray(v, fdt) for k, v in reference_initial_data(P["u0"]).items()}
    days = P["t_days"].size
    ts = np.arange(days, dtype=np.float64)
    ctrl = PIDController(rtol=rtol, atol=atol)

    def trajectory(p, init, cov):
        params = params_from_flat(model, p, n)
        y0 = model.initial_state(params, init, n)
        args, inputs = model.precompute(params, cov, n)
        return solve(
            model.vector_field,
            y0,
            args,
            ts=ts,
            inputs=inputs,
            solver=solver,
            stepsize_controller=ctrl,
            adjoint=adjoint,
            throw=throw,
        )

    def loss(p, init, cov, data):
        sol = trajectory(p, init, cov)
        return sm.loss_from_s_d(sol.ys["S"][:, 0], sol.ys["D"][:, 0], data)

    def steps(p, init, cov, data):
        return trajectory(p, init, cov).stats

    args = (jnp.asarray(P["p_init"], fdt), init, cov, jnp.asarray(P["data"], fdt))
    return loss, steps, args


def worker(a) -> dict:
    sm = h.reference_problem()
    P, fdt = _setup(sm, a.n_patches, a.days, a.dtype)
    import jax
    import jax.numpy as jnp
    import numpy as np

    rec = {
        "tool": a.worker.split("-")[0],
        "config": a.worker,
        "dtype": a.dtype,
        "n_patches": a.n_patches,
        "days": a.days,
        "solver": "tsit5",
    }
    if a.worker.startswith("epifit"):
        from epifit.ode import Bosh3, Tsit5

        solver = Bosh3() if a.worker == "epifit-bosh3" else Tsit5()
        rec["solver"] = type(solver).__name__.lower()
        loss, steps_fn, args = epifit_loss(
            sm, P, fdt, a.n_patches, a.rtol, a.atol, solver=solver
        )
        jax.block_until_ready(args)
        rec["base_rss_mb"] = round(h.maxrss_mb(), 1)
        import epifit

        rec["fwd_compile_s"], compiled = h.lower_compile(loss, *args, jit=epifit.jit)
        rec["fwd_s"], val, rec["repeats"] = h.median_time(compiled, args, a.repeats)
        st = jax.jit(steps_fn)(*args)
        rec["steps"] = int(st["num_accepted_steps"]) + int(st["num_rejected_steps"])
        rec["rhs_evals"] = int(st["num_rhs_evals"])
    else:
        from reference import peers

        mob = jnp.asarray(P["mobility"], fdt)
        cpl = jnp.asarray(P["coupling"], fdt)
        loss, solve = peers.build(a.worker, mob, cpl, rtol=a.rtol, atol=a.atol)
        args = peers.arguments(P, fdt)
        jax.block_until_ready(args)
        rec["solver"] = peers.PEERS[a.worker].solver
        rec["base_rss_mb"] = round(h.maxrss_mb(), 1)
        rec["fwd_compile_s"], compiled = h.lower_compile(loss, *args)
        rec["fwd_s"], val, rec["repeats"] = h.median_time(compiled, args, a.repeats)
        if solve is not None:
            st = jax.jit(lambda *xs: solve(*xs[:5]).stats)(*args)
            rec["steps"] = int(st["num_steps"])
    rec["loss"] = float(val)
    rec["peak_rss_mb"] = round(h.maxrss_mb(), 1)
    ref = h.ROOT / "out" / f"gradient_ref_{a.n_patches}_{a.days}.npz"
    if ref.exists():  # the tight float64 reference of benchmarks/gradient.py
        ref_loss = float(np.load(ref)["loss"])
        rec["loss_rel_err"] = abs(float(val) - ref_loss) / abs(ref_loss)
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-patches", type=int, default=280)
    ap.add_argument("--days", type=int, default=120)
    ap.add_argument(
        "--dtype",
        default="float32,float64",
        help="float32, float64 or both, comma-separated",
    )
    ap.add_argument("--tools", default="epifit,diffrax,odeint")
    ap.add_argument("--rtol", type=float, default=1e-3)
    ap.add_argument("--atol", type=float, default=1e-6)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=900.0, help="per worker, seconds")
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        h.emit(worker(a))
        return 0
    records = []
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
                "--repeats",
                str(a.repeats),
            ]
            rec = h.run_worker(Path(__file__), argv_w, a.timeout)
            rec.setdefault("config", cfg)
            rec.setdefault("tool", cfg.split("-")[0])
            rec.setdefault("dtype", dtype)
            rec.setdefault("n_patches", a.n_patches)
            print(
                f"  {cfg:32s} {dtype}: "
                + (
                    rec.get("error")
                    or f"compile {rec['fwd_compile_s']:.2f} s, "
                    f"eval {rec['fwd_s'] * 1e3:.1f} ms"
                ),
                flush=True,
            )
            group.append(rec)
        ref = next((r for r in group if r["config"] == "epifit" and "fwd_s" in r), None)
        bosh = next(
            (r for r in group if r["config"] == "epifit-bosh3" and "fwd_s" in r), None
        )
        h.add_ratios(
            group, ref, {"fwd_vs_epifit": "fwd_s", "compile_vs_epifit": "fwd_compile_s"}
        )
        h.add_ratios(group, bosh, {"fwd_vs_epifit_bosh3": "fwd_s"})
        for r in group:
            if "peak_rss_mb" in r and r.get("base_rss_mb"):
                r["rss_over_base"] = r["peak_rss_mb"] / r["base_rss_mb"]
        records += group
    print()
    print(
        h.table(
            records,
            [
                ("config", "config", ""),
                ("dtype", "dtype", ""),
                ("fwd_compile_s", "compile s", "{:.2f}"),
                ("fwd_s", "eval s", "{:.4f}"),
                ("fwd_vs_epifit", "eval x epifit", "{:.1f}"),
                ("fwd_vs_epifit_bosh3", "eval x bosh3", "{:.1f}"),
                ("compile_vs_epifit", "compile x epifit", "{:.1f}"),
                ("steps", "steps", "{}"),
                ("peak_rss_mb", "peak RSS MB", "{:.0f}"),
                ("base_rss_mb", "base RSS MB", "{:.0f}"),
                ("rss_over_base", "RSS/base", "{:.2f}"),
                ("loss", "loss", "{:.6g}"),
                ("loss_rel_err", "loss rel err", "{:.1e}"),
            ],
        )
    )
    h.write_json(a.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
