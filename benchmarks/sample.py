"""NUTS benchmark: epifit.sample against numpyro's NUTS over diffrax and
over `jax.experimental.ode.odeint`, on the boarding-school SIR
(`--problem boarding`, the default) or the 20-patch synthetic
metapopulation with its MLP (`--problem metapop`, 199 parameters; its
posterior, peers and records in `_sample_metapop.py`, the table in
`metapop_main`).

The boarding-school posterior: `models/sir.toml` with a Poisson likelihood
of `in_bed` (the 1978 outbreak, 14 days) and log-normal priors on beta
(median 1.7, sdlog 0.5), gamma (0.45, 0.5) and I0 (2, 1). Every tool runs the same NUTS
settings (chains one after another, `--warmup` adaptation steps, `--draws`
draws, target acceptance 0.8, tree depth at most `--max-tree-depth`, 10
by default), the same solver tolerances
(rtol = atol = 1e-6) and starts near the MAP: epifit from draws of its
Laplace approximation, numpyro at the MAP values (`init_to_value`).

epifit's default takes this density's gradient in forward mode over its
3 free parameters (`epifit.ode.forward_gradient`: one solve carrying 3
tangents, the gradient of the computed solution, its step-size control
included; `epifit.fitting.Objective.forward_pays` says when);
`epifit-forward` is epifit with the fit configuration's `adjoint =
"forward"` (`ForwardAdjoint`: forward sensitivities with respect to the
solve's own inputs, here also 3); the default tools run both.

Each tool runs in its own process, chain after chain, and prints a line per
finished chain, so a peer stopped at its time cap (`--cap`) is reported
with the chains it finished. Reported per tool: wall time of the sampling
(warm-up and draws, compiles included), the first chain's extra time (about
the compile), gradient evaluations of the draws (leapfrog steps), seconds per
gradient inside the draws of the chains after the first (the first chain
compiles), minimum bulk ESS over the three parameters and per second of
sampling (compiles included: the time to a result), maximum R-hat and
divergences.

    python benchmarks/sample.py --warmup 500 --draws 500 --json out/bench_sample.json
    python benchmarks/sample.py --problem metapop --chains 1 --warmup 100 \
        --draws 100 --cap 600 --json out/bench_sample_metapop.json
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h  # noqa: E402

PRIORS = {"beta": (1.7, 0.5), "gamma": (0.45, 0.5), "I0": (2.0, 1.0)}
N = 763.0
TOL = 1e-6
TOOLS = ("epifit", "epifit-forward", "numpyro-diffrax", "numpyro-odeint")
# epifit with an adjoint other than its default (the boarding school only):
# forward sensitivities, one batched solve for this model's 3 parameters
ADJOINT_VARIANTS = {"epifit-forward": "forward"}


def _data():
    import xarray as xr

    return xr.open_dataset(h.ROOT / "data" / "boarding_school_1978.nc").load()


def _epifit_spec():
    from epifit.model import loads_model

    text = (h.ROOT / "models" / "sir.toml").read_text()
    text = text.replace('family = "least_squares"', 'family = "poisson"')
    return loads_model(text, path="sir_poisson.toml")


def _fit_config(adjoint: str | None = None) -> dict:
    return {
        **({"adjoint": adjoint} if adjoint else {}),
        "rtol": TOL,
        "atol": TOL,
        "parameters": {
            p: {"prior": {"family": "lognormal", "median": m, "sdlog": s}}
            for p, (m, s) in PRIORS.items()
        },
    }


def _epifit_map(adjoint: str | None = None):
    import epifit

    return epifit.calibrate(
        _epifit_spec(), _data(), fit=_fit_config(adjoint), progress=False
    )


def worker_epifit(a, adjoint: str | None = None) -> None:
    import numpy as np

    import epifit

    fit = _epifit_map(adjoint)
    t = time.perf_counter()
    post = epifit.sample(init=fit, chains=a.chains, warmup=a.warmup, draws=a.draws,
                         seed=a.seed, max_tree_depth=a.max_tree_depth,
                         progress=False)  # fmt: skip
    timing = json.loads(post.data.posterior.attrs["timing"])
    p = post.data.posterior
    h.emit(
        {
            "chains": a.chains,
            "wall_s": time.perf_counter() - t,
            "sampling_s": timing["sampling_s"],
            "first_chain_extra_s": timing["warmup_s"][0]
            - float(np.median(timing["warmup_s"][1:] or [0.0])),
            "draws_s": [float(v) for v in timing["draws_s"]],
            "grads": [int(v) for v in post.data.sample_stats["n_steps"].sum("draw")],
            "draws": {k: p[k].values.tolist() for k in PRIORS},
            "divergences": int(post.data.sample_stats["diverging"].sum()),
        }
    )


def _numpyro_model(kind: str, y):
    import jax.numpy as jnp
    import numpyro
    import numpyro.distributions as dist

    ts = jnp.arange(14.0)

    def rhs(u, beta, gamma):
        new = beta * u[0] * u[1] / N
        return jnp.stack([-new, new - gamma * u[1]])

    if kind == "diffrax":
        import diffrax

        term = diffrax.ODETerm(lambda t, u, args: rhs(u, *args))

        def solve(beta, gamma, i0):
            sol = diffrax.diffeqsolve(
                term, diffrax.Tsit5(), 0.0, 13.0, 0.1, jnp.stack([N - i0, i0]),
                args=(beta, gamma), saveat=diffrax.SaveAt(ts=ts),
                stepsize_controller=diffrax.PIDController(rtol=TOL, atol=TOL),
                max_steps=4096, throw=False,
            )  # fmt: skip
            # a failed solve (a warm-up trajectory far out, where the system is
            # stiff: max_steps) is a NaN density, a divergent transition, as
            # epifit's density has it; with throw=True it ended the chain
            return sol.ys[:, 1]
    else:
        from jax.experimental.ode import odeint

        def solve(beta, gamma, i0):
            ys = odeint(lambda u, t, b, g: rhs(u, b, g), jnp.stack([N - i0, i0]), ts,
                        beta, gamma, rtol=TOL, atol=TOL)  # fmt: skip
            return ys[:, 1]

    def model():
        theta = {
            p: numpyro.sample(p, dist.LogNormal(math.log(m), s))
            for p, (m, s) in PRIORS.items()
        }
        mu = jnp.maximum(solve(theta["beta"], theta["gamma"], theta["I0"]), 1e-12)
        numpyro.sample("y", dist.Poisson(mu), obs=y)

    return model


def worker_numpyro(a, kind: str) -> None:
    import jax
    import numpy as np
    from numpyro.infer import MCMC, NUTS, init_to_value

    jax.config.update("jax_enable_x64", True)
    fit = _epifit_map()
    start = {p: float(fit.parameters[p]) for p in PRIORS}
    y = np.asarray(_data()["in_bed"].values, np.float64)
    model = _numpyro_model(kind, y)
    draws = {p: [] for p in PRIORS}
    grads, div = [], 0
    t0 = time.perf_counter()
    warm, run = [], []
    kernel = NUTS(model, target_accept_prob=0.8, max_tree_depth=a.max_tree_depth,
                  init_strategy=init_to_value(values=start))  # fmt: skip
    # one MCMC object: its compiled warm-up and sampler serve every chain
    mcmc = MCMC(kernel, num_warmup=a.warmup, num_samples=a.draws, num_chains=1,
                progress_bar=False)  # fmt: skip
    fields = ("num_steps", "diverging")
    for c in range(a.chains):
        key = jax.random.fold_in(jax.random.key(a.seed), c)
        t = time.perf_counter()
        mcmc.warmup(key, extra_fields=fields)
        warm.append(time.perf_counter() - t)
        t = time.perf_counter()
        mcmc.run(mcmc.post_warmup_state.rng_key, extra_fields=fields)
        run.append(time.perf_counter() - t)
        s = mcmc.get_samples()
        extra = mcmc.get_extra_fields()
        for p in PRIORS:
            draws[p].append(np.asarray(s[p]).tolist())
        grads.append(int(np.sum(extra["num_steps"])))
        div += int(np.sum(extra["diverging"]))
        h.emit(
            {
                "chains": c + 1,
                "sampling_s": time.perf_counter() - t0,
                "first_chain_extra_s": warm[0] - float(np.median(warm[1:] or [0.0])),
                "draws_s": run,
                "grads": grads,
                "draws": draws,
                "divergences": div,
            }
        )


def _summarise(tool: str, rec: dict, a) -> dict:
    """ESS, R-hat and rates from a worker's draws."""
    import arviz as az
    import numpy as np

    out = {"tool": tool, **{k: v for k, v in rec.items() if k != "draws"}}
    if "draws" not in rec:
        return out
    post = {p: np.asarray(v) for p, v in rec["draws"].items()}
    idata = az.from_dict(posterior=post)
    ess = az.ess(idata, method="bulk")
    out["min_ess_bulk"] = float(min(ess[p].values for p in PRIORS))
    if rec["chains"] > 1:
        rhat = az.rhat(idata)
        out["max_r_hat"] = float(max(rhat[p].values for p in PRIORS))
    out["ess_per_s"] = out["min_ess_bulk"] / rec["sampling_s"]
    # the draws of the chains after the first (the first compiles)
    later = slice(1, None) if rec["chains"] > 1 else slice(None)
    out["s_per_grad"] = sum(rec["draws_s"][later]) / max(sum(rec["grads"][later]), 1)
    out["grads"] = sum(rec["grads"])
    out["means"] = {p: float(post[p].mean()) for p in PRIORS}
    out["complete"] = rec["chains"] == a.chains
    return out


def _run_capped(tool: str, a, extra=(), summarise=None) -> dict:
    """The tool's worker, stopped at `--cap` seconds (a peer at `--peer-cap`,
    where given); its last complete line."""
    ours = tool.startswith("epifit")
    cap = a.cap if ours or a.peer_cap is None else a.peer_cap
    argv = [sys.executable, __file__, "--worker", tool]
    argv += ["--chains", str(a.chains), "--warmup", str(a.warmup)]
    argv += ["--draws", str(a.draws), "--seed", str(a.seed)]
    argv += ["--max-tree-depth", str(a.max_tree_depth), *extra]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=cap)
        stdout, note = proc.stdout, "" if proc.returncode == 0 else proc.stderr
    except subprocess.TimeoutExpired as e:
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        note = f"stopped at its time cap of {cap:.0f} s"
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    rec = json.loads(lines[-1]) if lines else {}
    if note:
        rec["note"] = _reason(note)
    return (summarise or _summarise)(tool, rec, a)


def _reason(stderr: str) -> str:
    """What stopped a worker: the last exception line of its standard error
    (`SomeError: message`; JAX's closing notice about filtered frames is not
    one), else its last line."""
    lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
    found = [ln for ln in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception): ", ln)]
    return found[-1] if found else (lines[-1] if lines else "")


def _summarise_metapop(tool: str, rec: dict, a) -> dict:
    """Case metapop: ESS and R-hat over kappa, alpha, gamma and the scalers
    (complete chains only), the cost per gradient and per NUTS iteration,
    and the issue's target run (4 chains, 500 + 500) extrapolated from it."""
    import statistics

    import arviz as az
    import numpy as np

    out = {"tool": tool, **{k: v for k, v in rec.items() if k != "draws"}}
    if rec.get("draws"):
        post = {k: np.asarray(v) for k, v in rec["draws"].items()}
        idata = az.from_dict(posterior=post)
        out["min_ess_bulk"] = float(min(az.ess(idata, method="bulk")[k] for k in post))
        out["ess_per_s"] = out["min_ess_bulk"] / rec["sampling_s"]
        if rec["chains"] > 1:
            out["max_r_hat"] = float(max(az.rhat(idata)[k] for k in post))
        out["means"] = {k: float(post[k].mean()) for k in ("kappa", "alpha", "gamma")}
        out |= _intervals(post)
    warm_s, draws_s = rec.get("warmup_s", []), rec.get("draws_s", [])
    if tool == "epifit" and sum(rec.get("grads", [])):  # warm-up's not recorded
        later = slice(1, None) if len(draws_s) > 1 else slice(None)
        out["s_per_grad"] = sum(draws_s[later]) / max(sum(rec["grads"][later]), 1)
        if len(warm_s) > 1:
            out["compile_s"] = warm_s[0] - statistics.median(warm_s[1:])
    elif "warmup_grads" in rec:  # compiled ahead of time: no compile inside
        n = sum(rec["warmup_grads"]) + sum(rec["grads"])
        out["s_per_grad"] = (sum(warm_s) + sum(draws_s)) / max(n, 1)
        out["grads_warmup"] = sum(rec["warmup_grads"])
    iters = sum(rec.get("draw_iterations", []))
    if iters and sum(draws_s):
        out["s_per_iter"] = sum(draws_s) / iters
        out["grads_per_iter"] = sum(rec["grads"]) / iters
        out["iter_phase"] = "draws"
    elif sum(rec.get("iterations", [])):
        out["s_per_iter"] = sum(warm_s) / sum(rec["iterations"])
        out["grads_per_iter"] = sum(rec["warmup_grads"]) / sum(rec["iterations"])
        out["iter_phase"] = "warm-up"
    if "s_per_iter" in out:
        out["target_wall_s_extrapolated"] = (
            out.get("compile_s", 0.0) + 4 * (500 + 500) * out["s_per_iter"]
        )
    out["grads"] = sum(rec.get("grads", []))
    out["complete"] = rec.get("chains") == a.chains
    if iters and rec.get("divergences", 0) >= iters:  # a chain that never moved
        out.pop("min_ess_bulk", None), out.pop("ess_per_s", None)
        out["note"] = "every draw diverged: the chain did not move (a start of "
        out["note"] += "-inf density?); its ESS is not reported"
    return out


def _intervals(post: dict) -> dict:
    """The 95% credible intervals (2.5% and 97.5% quantiles of the pooled
    draws) of kappa, alpha and gamma, and which contain the data's truth."""
    import _sample_metapop as mp
    import numpy as np

    truth = mp.true_values()
    ci = {k: np.quantile(post[k], [0.025, 0.975]).tolist() for k in truth}
    held = [k for k, (lo, hi) in ci.items() if lo <= truth[k] <= hi]
    return {"ci95": ci, "truth": truth, "truth_in_ci95": f"{len(held)}/{len(ci)}"}


def _tools(a, every) -> list[str]:
    """The tools `--tools` names, or (without it) `every` tool of the case."""
    if a.tools is None:
        return list(every)
    return [t.strip() for t in a.tools.split(",") if t.strip()]


def metapop_main(a, ap) -> int:
    """`--problem metapop`: the MAP (calibrate, or `--fit`), then each tool."""
    import tempfile

    import jax

    jax.config.update("jax_enable_x64", True)
    import _sample_metapop as mp

    if a.block < 1 or a.warmup % a.block or a.draws % a.block or a.draws < 1:
        ap.error(f"--warmup {a.warmup} and --draws {a.draws} must be multiples "
                 f"of --block {a.block} (>= 1), with at least one draw")  # fmt: skip
    if a.worker:
        if a.worker == "epifit":
            mp.worker_epifit(a, a.fit)
        else:
            mp.worker_numpyro(a, a.worker.split("-")[1], a.fit)
        return 0
    known = [t for t in TOOLS if t not in ADJOINT_VARIANTS]
    for t in (tools := _tools(a, known)):
        if t not in known:
            ap.error(f"--tools: unknown tool {t!r} for --problem metapop; "
                     f"expected some of {known}")  # fmt: skip
    fit_path, head = a.fit, {"tool": "calibrate (MAP)"}
    if fit_path is None:
        t = time.perf_counter()
        fit = mp.epifit_map(iterations=a.fit_iterations)
        head |= {"wall_s": time.perf_counter() - t, "loss": fit.loss,
                 "iterations": fit.iterations, "message": fit.message}  # fmt: skip
        fit_path = str(Path(tempfile.mkdtemp()) / "FIT.nc")
        fit.to_netcdf(fit_path)
    print(f"MAP: {head}")
    extra = ["--problem", "metapop", "--block", str(a.block), "--fit", fit_path]
    extra += ["--chain-method", a.chain_method] if a.chain_method else []
    extra += ["--mass-matrix", a.mass_matrix]
    extra += ["--fix-neural", a.fix_neural] if a.fix_neural else []
    extra += ["--no-whiten"] * a.no_whiten
    records = [_run_capped(t, a, extra, _summarise_metapop) for t in tools]
    cols = [
        ("tool", "tool", ""),
        ("chains", "chains done", ""),
        ("iterations", "iterations", ""),
        ("sampling_s", "sampling s", "{:.1f}"),
        ("compile_s", "compile s", "{:.1f}"),
        ("grads_warmup", "grads (warm-up)", ""),
        ("grads", "grads (draws)", ""),
        ("s_per_grad", "s/grad", "{:.2e}"),
        ("s_per_iter", "s/iter", "{:.2f}"),
        ("grads_per_iter", "grads/iter", "{:.0f}"),
        ("iter_phase", "iter phase", ""),
        ("min_ess_bulk", "min ESS", "{:.0f}"),
        ("ess_per_s", "ESS/s", "{:.3f}"),
        ("max_r_hat", "R-hat", "{:.3f}"),
        ("divergences", "div", ""),
        ("truth_in_ci95", "truth in 95% CI", ""),
        ("target_wall_s_extrapolated", "4x(500+500) s, extrap.", "{:.0f}"),
        ("note", "note", ""),
    ]
    print(h.table(records, cols))
    h.write_json(a.json, [head, *records])
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chains", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--draws", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tree-depth", type=int, default=10,
                    help="every tool's NUTS tree depth limit")  # fmt: skip
    ap.add_argument("--cap", type=float, default=900.0, help="seconds per tool")
    ap.add_argument("--peer-cap", type=float, help="seconds per peer (default --cap)")
    ap.add_argument("--tools", help="comma-separated (default: every tool of "
                    "the problem; metapop has no epifit-forward)")  # fmt: skip
    ap.add_argument("--worker", choices=TOOLS, help=argparse.SUPPRESS)
    ap.add_argument("--json")
    ap.add_argument("--problem", choices=("boarding", "metapop"), default="boarding")
    ap.add_argument(
        "--block",
        type=int,
        default=10,
        help="metapop: iterations per progress record (epifit's chunk)",
    )
    ap.add_argument(
        "--chain-method", default=None, help="metapop: epifit.sample's chain_method"
    )
    ap.add_argument("--mass-matrix", choices=("diagonal", "dense"),
                    default="diagonal", help="metapop: every tool's")  # fmt: skip
    ap.add_argument("--no-whiten", action="store_true", help="metapop: every "
                    "tool on the unconstrained coordinates, not the Laplace "
                    "approximation's whitened ones")  # fmt: skip
    ap.add_argument("--fix-neural", nargs="?", const="all", choices=("all", "hidden"),
                    help="metapop: sample the rates and scalers given the "
                    "MLP's weights at the MAP (all), or given its hidden layers, "
                    "the output layer sampled too (hidden: a Bayesian last "
                    "layer)")  # fmt: skip
    ap.add_argument("--fit", help="metapop: a FIT.nc of the MAP to start from "
                    "(default: calibrate it first)")  # fmt: skip
    ap.add_argument("--fit-iterations", type=int, default=400, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.problem == "metapop":
        return metapop_main(a, ap)
    if a.worker:
        import jax

        jax.config.update("jax_enable_x64", True)
        if a.worker.startswith("epifit"):
            worker_epifit(a, ADJOINT_VARIANTS.get(a.worker))
        else:
            worker_numpyro(a, a.worker.split("-")[1])
        return 0
    for t in (tools := _tools(a, TOOLS)):
        if t not in TOOLS:
            ap.error(f"--tools: unknown tool {t!r}; expected some of {list(TOOLS)}")
    records = [_run_capped(t, a) for t in tools]
    best_peer = max(
        (
            r.get("ess_per_s", 0.0)
            for r in records
            if not r["tool"].startswith("epifit")
        ),  # fmt: skip
        default=0.0,
    )
    for r in records:
        if r["tool"].startswith("epifit") and best_peer:
            r["ess_per_s_vs_fastest_peer"] = r.get("ess_per_s", 0.0) / best_peer
    cols = [
        ("tool", "tool", ""),
        ("chains", "chains", ""),
        ("sampling_s", "sampling s", "{:.1f}"),
        ("first_chain_extra_s", "1st chain extra s", "{:.1f}"),
        ("grads", "grads (draws)", ""),
        ("s_per_grad", "s/grad", "{:.2e}"),
        ("min_ess_bulk", "min ESS", "{:.0f}"),
        ("ess_per_s", "ESS/s", "{:.2f}"),
        ("max_r_hat", "R-hat", "{:.3f}"),
        ("divergences", "div", ""),
        ("note", "note", ""),
    ]
    print(h.table(records, cols))
    for r in records:
        if "ess_per_s_vs_fastest_peer" in r:
            ratio = r["ess_per_s_vs_fastest_peer"]
            print(f"{r['tool']} ESS/s vs the fastest peer: {ratio:.1f}x")
    h.write_json(a.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
