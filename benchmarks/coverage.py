"""Coverage of the Laplace intervals, measured on synthetic datasets.

For each model (SIR and SEIR, Poisson daily incidence) the benchmark draws
`--datasets` parameter vectors from the fit's priors (log-normal on beta,
gamma and, for SEIR, sigma), solves the model with SciPy (DOP853 at rtol
1e-11: an independent generator, not epifit's solver), adds Poisson noise,
and fits every dataset with `epifit.calibrate` (MAP under the same priors,
the default phases, the Laplace approximation by `method = "hessian"`). It
then counts, per parameter, how often the 95% and the 50% intervals contain
the truth, with Clopper-Pearson 95% bounds on those shares. Where the
approximation is honest the shares are 95% and 50% up to Monte-Carlo error:
the truths are drawn from the prior the fit uses, so the exact posterior's
credible intervals cover at their nominal rate on average.

The datasets are fitted as the patches of one problem: every parameter is
`per_patch`, there is no coupling, so the objective is a sum of independent
terms, the MAP of the joint fit is every dataset's own MAP and the Hessian is
block diagonal (each patch's block is its own fit's Hessian). That is one
compile per model instead of one per dataset; `tests/test_coverage.py`
checks on a few datasets that the joint fit gives the separate fits'
estimates and intervals.

    python benchmarks/coverage.py --datasets 200 --json out/bench_coverage.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

MODELS = {
    # name: (compartments, free parameter -> (prior median, prior sdlog))
    "sir": (("S", "I", "R"), {"beta": (0.5, 0.2), "gamma": (0.25, 0.2)}),
    "seir": (
        ("S", "E", "I", "R"),
        {"beta": (0.6, 0.2), "sigma": (0.3, 0.2), "gamma": (0.25, 0.2)},
    ),
}
POPULATION = 10000.0
SEEDED = 10.0  # initially infected (SIR) or exposed (SEIR), fixed
LEVELS = (0.95, 0.5)


def model_toml(name: str) -> str:
    """The model file of `name`: every free parameter per patch, Poisson
    incidence of the infection flow."""
    compartments, free = MODELS[name]
    first = compartments[1]  # I (SIR) or E (SEIR)
    lines = [
        f'name = "{name}_poisson"',
        f"compartments = {list(compartments)!r}".replace("'", '"'),
        "[parameters]",
        f"N = {{ value = {POPULATION}, fixed = true }}",
        f"X0 = {{ value = {SEEDED}, fixed = true }}",
    ]
    for p, (median, _) in free.items():
        lines.append(
            f'{p} = {{ value = {median}, transform = "softplus", per_patch = true }}'
        )
    lines += [
        "[[infections]]",
        'from = "S"',
        f'to = "{first}"',
        'transmission = "beta"',
        'infectious = ["I"]',
        'normalize = "population"',
        'population = "N"',
    ]
    if name == "seir":
        lines += ["[[transitions]]", 'from = "E"', 'to = "I"', 'rate = "sigma"']
    lines += ["[[transitions]]", 'from = "I"', 'to = "R"', 'rate = "gamma"']
    lines += ["[initial]", 'S = "N - X0"', f'{first} = "X0"']
    lines += [
        "[[observations]]",
        'name = "cases"',
        'kind = "flow"',
        f'transition = "S->{first}"',
        'family = "poisson"',
    ]
    return "\n".join(lines) + "\n"


def fit_config(name: str, tolerance: float = 1e-10) -> dict:
    """The priors the truths are drawn from, and the Laplace method. The
    stopping tolerances are relative to the loss, the sum over all the
    datasets fitted together: they are set tight (`tolerance` on the
    gradient, no loss-change stop) so that each dataset's MAP is reached."""
    _, free = MODELS[name]
    return {
        "rtol": 1e-9,
        "atol": 1e-9,
        "tolerance": tolerance,
        "loss_tolerance": 0.0,
        "parameters": {
            p: {"prior": {"family": "lognormal", "median": m, "sdlog": s}}
            for p, (m, s) in free.items()
        },
        "uncertainty": {"method": "hessian", "level": 0.95},
    }


def draw_truths(name: str, n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    _, free = MODELS[name]
    return {p: m * np.exp(s * rng.standard_normal(n)) for p, (m, s) in free.items()}


def incidence(name: str, truth: dict[str, float], days: int) -> np.ndarray:
    """Expected daily new infections (day 0 has none: NaN), by SciPy."""
    from scipy.integrate import solve_ivp

    n, b, g = POPULATION, truth["beta"], truth["gamma"]
    if name == "sir":

        def f(t, u):
            new = b * u[0] * u[1] / n
            return [-new, new - g * u[1]]

        u0 = [n - SEEDED, SEEDED]
    else:
        s = truth["sigma"]

        def f(t, u):
            new = b * u[0] * u[2] / n
            return [-new, new - s * u[1], s * u[1] - g * u[2]]

        u0 = [n - SEEDED, SEEDED, 0.0]
    t = np.arange(days, dtype=float)
    sol = solve_ivp(
        f, (0.0, t[-1]), u0, t_eval=t, method="DOP853", rtol=1e-11, atol=1e-8
    )
    return np.concatenate([[np.nan], -np.diff(sol.y[0])])


def datasets(name: str, truths: dict[str, np.ndarray], days: int, rng):
    """One dataset per truth, as the patches of one `xarray.Dataset`."""
    import xarray as xr

    n = len(next(iter(truths.values())))
    mu = np.stack(
        [incidence(name, {p: v[i] for p, v in truths.items()}, days) for i in range(n)],
        axis=1,
    )
    y = np.where(np.isnan(mu), np.nan, rng.poisson(np.nan_to_num(mu)).astype(float))
    dates = np.datetime64("2020-03-01") + np.arange(days).astype("timedelta64[D]")
    patches = [f"d{i:03d}" for i in range(n)]
    return xr.Dataset(
        {"cases": (("time", "patch"), y)}, coords={"time": dates, "patch": patches}
    )


def softplus_inverse(c: np.ndarray) -> np.ndarray:
    return c + np.log(-np.expm1(-c))


def covered(res, truths: dict[str, np.ndarray]) -> dict[str, dict[float, np.ndarray]]:
    """Per parameter and level: does the interval contain the truth, per
    dataset. Intervals are `x ± z se(x)` on the unconstrained (softplus)
    scale, mapped through the transform, as `FitResult.table` writes them
    (the 95% ones are checked against the table)."""
    from statistics import NormalDist

    labels = list(res.labels)
    se = np.sqrt(np.diag(res.covariance))
    rows = {r["label"]: r for r in res.table}
    out = {}
    for p, v in truths.items():
        idx = [labels.index(f"{p}[d{i:03d}]") for i in range(len(v))]
        x, s, t = res.x[idx], se[idx], softplus_inverse(v)
        upper = np.array([rows[f"{p}[d{i:03d}]"]["upper"] for i in range(len(v))])
        hi95 = np.logaddexp(0.0, x + NormalDist().inv_cdf(0.975) * s)
        np.testing.assert_allclose(hi95, upper, rtol=1e-9)  # the table's intervals
        out[p] = {
            level: np.abs(t - x) <= NormalDist().inv_cdf(0.5 + level / 2) * s
            for level in LEVELS
        }
    return out


def clopper_pearson(k: int, n: int, alpha: float = 0.05) -> tuple[float, float]:
    from scipy.stats import beta

    lo = 0.0 if k == 0 else float(beta.ppf(alpha / 2, k, n - k + 1))
    hi = 1.0 if k == n else float(beta.ppf(1 - alpha / 2, k + 1, n - k))
    return lo, hi


def run(name: str, n: int, days: int, seed: int, batch: int = 200) -> dict:
    """Draw, simulate, fit; the coverage record of one model. The datasets
    are fitted `batch` at a time (the Hessian of a joint fit grows with the
    square of its parameters)."""
    import epifit
    from epifit.model import loads_model

    rng = np.random.default_rng(seed)
    spec = loads_model(model_toml(name), path=f"{name}_poisson.toml")
    hits: dict[str, dict[float, list]] = {}
    wall, converged, messages = 0.0, True, set()
    for start in range(0, n, batch):
        truths = draw_truths(name, min(batch, n - start), rng)
        ds = datasets(name, truths, days, rng)
        t = time.perf_counter()
        res = epifit.calibrate(spec, ds, fit=fit_config(name), progress=False)
        wall += time.perf_counter() - t
        converged &= bool(res.converged)
        messages |= {res.message, res.uncertainty.get("message", "")} - {""}
        for p, by_level in covered(res, truths).items():
            for level, hit in by_level.items():
                hits.setdefault(p, {}).setdefault(level, []).append(hit)
    record = {
        "model": name,
        "datasets": n,
        "days": days,
        "seed": seed,
        "converged": converged,
        "message": "; ".join(sorted(messages)),
        "wall_s": wall,
        "coverage": {},
    }
    for p, by_level in hits.items():
        record["coverage"][p] = {}
        for level, parts in by_level.items():
            k = int(np.concatenate(parts).sum())
            lo, hi = clopper_pearson(k, n)
            record["coverage"][p][str(level)] = {
                "covered": k,
                "share": k / n,
                "ci95": [lo, hi],
            }
    return record


def print_table(records: list[dict]) -> None:
    print(f"{'model':6} {'parameter':9} {'level':>5} {'share':>7}  {'95% CI':>15}")
    for r in records:
        for p, by_level in r["coverage"].items():
            for level, c in by_level.items():
                lo, hi = c["ci95"]
                print(
                    f"{r['model']:6} {p:9} {float(level):5.2f} {c['share']:7.3f}"
                    f"  [{lo:.3f}, {hi:.3f}]"
                )
        print(
            f"# {r['model']}: {r['datasets']} datasets x {r['days']} days, fitted "
            f"in {r['wall_s']:.1f} s; converged={r['converged']} ({r['message']})"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--datasets", type=int, default=200)
    ap.add_argument("--days", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=200, help="datasets per joint fit")
    ap.add_argument("--models", default="sir,seir")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    import jax

    jax.config.update("jax_enable_x64", True)
    names = [m.strip() for m in a.models.split(",") if m.strip()]
    for m in names:
        if m not in MODELS:
            ap.error(f"--models: unknown model {m!r}; expected some of {list(MODELS)}")
    records = [
        run(m, a.datasets, a.days, a.seed + i, a.batch) for i, m in enumerate(names)
    ]
    print_table(records)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        tmp = a.json.with_name(a.json.name + ".tmp")
        tmp.write_text(json.dumps(records, indent=1, default=float))
        tmp.replace(a.json)
    return 0 if all(math.isfinite(r["wall_s"]) for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
