"""Forecast benchmark: a vectorised ensemble (vmap) against a Python loop.

On the reference problem of `benchmarks/reference/problem.py` (default 280
patches, `models/seird_metapop_mobility.toml`): the reference covariates and
initial state of `--fit-days` days (default 30) are the "data"; the forecast
runs 3 scenarios (the carry-forward baseline; mobility x 0.7 everywhere; a
28-day lockdown of 10 patches, their coupling rows and columns x 0 and their
transmission x 0.8) for `--samples` parameter draws (default 200) over
`--days` days past the data (default 90), at the reference tolerances (rtol
1e-3, atol 1e-6).

There is no fit of the reference problem to take a Laplace covariance from,
so the draws come from a small diagonal covariance around the reference
starting point `p_init`: standard deviation `--sd` (default 0.05) for every
unconstrained coordinate (3 epidemic parameters, the per-patch coupling
scalers and the 176 MLP weights).

Each path runs in its own process (peak RSS is its own):

* `vmap`: `epifit.forecasting.prepare_forecast(...)`, then `iter_ensemble`:
  every scenario through one compiled function, `vmap` over chunks of
  samples (default chunk: `default_chunk`, by memory and, on CPU, by state
  size), each scenario summarised to quantiles as it completes (timed
  apart; memory holds one scenario's trajectories at most);
* `loop`: the same compiled single-sample trajectory (`trajectory`, the
  function the ensemble vmaps), called once per scenario and sample from a
  Python loop (results copied to the host, no summaries).

Both report the compile time (lower + compile, ahead of time), the run time
as wall time and as this process's CPU time (the CPU figure is the steadier
one on a shared machine), per-solve time and peak RSS, and check that they
agree on the point estimate. The speedup of the vectorised ensemble is
printed. On CPU, batching samples pays while a chunk's state is small; for
the 280-patch model (4480 state elements per sample) the default chunk is 1.

    python benchmarks/forecast.py --samples 200 --days 90 --json out/forecast.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as h  # noqa: E402

N_LOCKED = 10  # patches in the lockdown scenario


def _setup(a):
    """The problem (reference arrays as a dataset), parameters, covariance and
    scenarios."""
    sm = h.reference_problem()
    import jax

    jax.config.update("jax_enable_x64", a.dtype == "float64")
    import numpy as np
    import xarray as xr
    from helpers import params_from_flat, reference_covariates, reference_initial_data

    from epifit.forecasting import Change, Scenario
    from epifit.simulation import Problem

    P = sm.make_problem(a.n_patches, a.fit_days, 0)
    n = a.n_patches
    labels = [f"p{i:03d}" for i in range(n)]
    cov = reference_covariates(P)
    init = reference_initial_data(P["u0"])
    data_vars = {
        "mobility": (("time", "patch", "feature"), cov["mobility"]),
        "coupling": (("time", "patch", "patch_to"), cov["coupling"]),
    }
    for name, v in init.items():
        dims = ("patch",) if v.ndim == 1 else (f"stage_{name[8:]}", "patch")
        data_vars[name] = (dims, v)
    # observations as context: daily new infections and deaths (fractions)
    for k, name in enumerate(("new_infections", "new_deaths")):
        obs = np.full((a.fit_days, n), np.nan)
        obs[1:] = P["data"][:, k, :]
        data_vars[name] = (("time", "patch"), obs)
    dates = np.datetime64("2020-03-01") + np.arange(a.fit_days).astype("timedelta64[D]")
    ds = xr.Dataset(
        data_vars, coords={"time": dates, "patch": labels, "patch_to": labels}
    )
    model = h.ROOT / "models" / "seird_metapop_mobility.toml"
    problem = Problem(model, ds, dtype=a.dtype)
    params = params_from_flat(problem.model, P["p_init"], n)
    n_free = P["p_init"].size
    covariance = np.diag(np.full(n_free, a.sd**2))
    start = a.fit_days + min(7, a.days - 1)
    end = min(start + 28, a.fit_days + a.days)
    locked = labels[:: max(1, n // N_LOCKED)][:N_LOCKED]
    scenarios = [
        Scenario("distancing", [Change(covariate="mobility", scale=0.7)]),
        Scenario(
            "lockdown",
            [
                Change(
                    covariate="coupling",
                    inflow=locked,
                    outflow=locked,
                    scale=0.0,
                    start=start,
                    end=end,
                ),
                Change(
                    transmission=True,
                    patches=locked,
                    scale=0.8,
                    start=start,
                    end=end,
                ),
            ],
        ),
    ]
    return problem, params, covariance, scenarios


def _prepare(a):
    from epifit.forecasting import prepare_forecast

    problem, params, covariance, scenarios = _setup(a)
    return prepare_forecast(
        problem,
        scenarios,
        params=params,
        covariance=covariance,
        days=a.days,
        samples=a.samples,
        seed=0,
        rtol=a.rtol,
        atol=a.atol,
    )


def worker(a) -> dict:
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    import epifit
    from epifit.forecasting._ensemble import (
        _compiled,
        _device,
        default_chunk,
        iter_ensemble,
        trajectory,
    )

    prep = _prepare(a)
    cfg = prep.config
    rec = {
        "config": a.worker,
        "n_patches": a.n_patches,
        "fit_days": a.fit_days,
        "days": a.days,
        "samples": a.samples,
        "scenarios": len(prep.bound.names),
        "dtype": a.dtype,
    }
    n_solves = len(prep.bound.names) * prep.xs.shape[0]
    start = prep.horizon.n_fit
    template = jax.tree.map(lambda v: jnp.asarray(v, cfg.dtype), prep.template)
    first = jax.tree.map(_device(cfg.dtype), next(prep.scenario_data()))
    jax.block_until_ready((template, first))
    rec["base_rss_mb"] = round(h.maxrss_mb(), 1)
    if a.worker == "vmap":
        chunk = a.chunk_size or default_chunk(cfg, prep.xs.shape[0])
        rec["chunk_size"] = chunk
        xs0 = jnp.asarray(prep.xs[:chunk], cfg.dtype)
        rec["compile_s"], _ = h.lower_compile(
            _compiled(cfg), xs0, template, first, jit=lambda f: f
        )
        jax.block_until_ready(_compiled(cfg)(xs0, template, first))  # warm
        spent = {"wall": 0.0, "cpu": 0.0}

        def timed(it):
            """The ensemble's time, apart from the summaries between scenarios."""
            while True:
                wall, cpu = time.perf_counter(), time.process_time()
                try:
                    item = next(it)
                except StopIteration:
                    return
                spent["wall"] += time.perf_counter() - wall
                spent["cpu"] += time.process_time() - cpu
                yield item

        wall = time.perf_counter()
        runs = iter_ensemble(
            cfg, prep.xs, prep.template, prep.scenario_data(), chunk_size=chunk
        )
        ds = prep.summarize(timed(runs))
        rec["run_s"], rec["run_cpu_s"] = spent["wall"], spent["cpu"]
        rec["summary_s"] = time.perf_counter() - wall - spent["wall"]
        est = ds["estimate_new_infections"].values[:, start:].sum(axis=(1, 2))
        rec["failed_samples"] = [int(v) for v in ds["failed_samples"].values]
    else:
        single = epifit.jit(functools.partial(trajectory, cfg))
        xs = jnp.asarray(prep.xs, cfg.dtype)
        datas = [jax.tree.map(_device(cfg.dtype), d) for d in prep.scenario_data()]
        rec["compile_s"], _ = h.lower_compile(
            single, xs[0], template, first, jit=lambda f: f
        )
        jax.block_until_ready(single(xs[0], template, first))  # warm
        wall, cpu = time.perf_counter(), time.process_time()
        est = []
        for data in datas:
            for k in range(xs.shape[0]):
                series, _ = jax.tree.map(np.asarray, single(xs[k], template, data))
                if k == 0:
                    est.append(np.nansum(series["new_infections"][start:]))
        rec["run_s"] = time.perf_counter() - wall
        rec["run_cpu_s"] = time.process_time() - cpu
        est = np.asarray(est)
    rec["per_solve_ms"] = 1e3 * rec["run_s"] / n_solves
    rec["per_solve_cpu_ms"] = 1e3 * rec["run_cpu_s"] / n_solves
    rec["estimate_cumulative"] = [float(v) for v in est]
    rec["peak_rss_mb"] = round(h.maxrss_mb(), 1)
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--days", type=int, default=90, help="forecast days past the data")
    ap.add_argument("--fit-days", type=int, default=30, help="days of 'data'")
    ap.add_argument("--n-patches", type=int, default=280)
    ap.add_argument("--sd", type=float, default=0.05, help="sd of the draws")
    ap.add_argument("--rtol", type=float, default=1e-3)
    ap.add_argument("--atol", type=float, default=1e-6)
    ap.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    ap.add_argument("--chunk-size", type=int, help="samples per compiled call")
    ap.add_argument("--paths", default="vmap,loop", help="vmap, loop or both")
    ap.add_argument("--timeout", type=float, default=1800.0, help="per worker, s")
    ap.add_argument("--json", default=None, help="write the records here")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        h.emit(worker(a))
        return 0
    records = []
    for path in a.paths.split(","):
        argv_w = ["--worker", path] + [
            f"--{k.replace('_', '-')}={v}"
            for k, v in vars(a).items()
            if k not in ("worker", "json", "paths", "timeout") and v is not None
        ]
        rec = h.run_worker(Path(__file__), argv_w, a.timeout)
        rec.setdefault("config", path)
        print(
            f"  {path:5s}: "
            + (
                rec.get("error")
                or f"compile {rec['compile_s']:.1f} s, run {rec['run_s']:.1f} s "
                f"(CPU {rec['run_cpu_s']:.1f} s; {rec['per_solve_ms']:.1f} ms per "
                f"solve), peak RSS {rec['peak_rss_mb']:.0f} MB"
            ),
            flush=True,
        )
        records.append(rec)
    by = {r["config"]: r for r in records if "run_s" in r}
    if "vmap" in by and "loop" in by:
        v, lp = by["vmap"], by["loop"]
        v["speedup_run"] = lp["run_s"] / v["run_s"]
        v["speedup_cpu"] = lp["run_cpu_s"] / v["run_cpu_s"]
        v["speedup_with_compile"] = (lp["run_s"] + lp["compile_s"]) / (
            v["run_s"] + v["compile_s"]
        )
        import numpy as np

        agree = np.allclose(
            v["estimate_cumulative"], lp["estimate_cumulative"], rtol=1e-6
        )
        v["loop_agrees"] = bool(agree)
    print()
    print(
        h.table(
            records,
            [
                ("config", "path", ""),
                ("scenarios", "scenarios", "{}"),
                ("samples", "samples", "{}"),
                ("days", "days", "{}"),
                ("n_patches", "patches", "{}"),
                ("chunk_size", "chunk", "{}"),
                ("compile_s", "compile s", "{:.1f}"),
                ("run_s", "run s", "{:.1f}"),
                ("run_cpu_s", "run CPU s", "{:.1f}"),
                ("per_solve_ms", "ms/solve", "{:.1f}"),
                ("summary_s", "summary s", "{:.1f}"),
                ("peak_rss_mb", "peak RSS MB", "{:.0f}"),
                ("base_rss_mb", "base RSS MB", "{:.0f}"),
            ],
        )
    )
    if "vmap" in by and "speedup_run" in by["vmap"]:
        v = by["vmap"]
        print(
            f"\nspeedup of the vectorised ensemble over the Python loop: "
            f"{v['speedup_run']:.2f}x (wall), {v['speedup_cpu']:.2f}x (CPU time), "
            f"{v['speedup_with_compile']:.2f}x (wall, with compilation); point "
            f"estimates agree: {v['loop_agrees']}"
        )
    h.write_json(a.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
