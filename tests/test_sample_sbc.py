"""Simulation-based calibration of `epifit.sample` (slow).

Where the truths are drawn from the prior and the data from the model, the
rank of each truth among independent posterior draws is uniform (Talts et
al. 2018). Fifty Poisson SIR datasets (30 days; truths from the fit's
log-normal priors; expected incidence by SciPy's DOP853 in
`benchmarks/coverage.py`, an independent generator) pass a chi-square
uniformity test of those ranks; twenty-five datasets with overdispersed
counts (negative binomial, fitted with the same Poisson likelihood, whose
posteriors are therefore too narrow) fail it, so the test can fail.

Cost: the compiles dominate (calibrate's loop, the sampler's warm-up and chunk
programs, the posterior's predictive programs), so all 75 datasets are sampled as the
uncoupled patches of one problem: the posterior is the product of the
datasets' own posteriors, and one chain (200 warm-up, 57 draws, thinned by 3
to 19) samples them all with one set of compiled programs, from the MAP of
a short L-BFGS run without a Laplace approximation. The rank test needs the
thinned draws to be nearly independent, not many: with 19 draws the ranks
take 20 values, 4 to each of the 5 bins, and the chi-square test of 50 ranks
is the same test as with 64 draws. R-hat (split over the chain's halves), ESS
and divergences are reported in the failure messages, not asserted.

The SIR is written in its growth rate `r = beta - gamma` and `gamma`: in
`(beta, gamma)` 30 days of incidence pin `beta - gamma` down and leave the
two correlated at 0.98-0.999, and a diagonal mass matrix then needs trees of
depth 8; in `(r, gamma)` the correlations are -0.1 to -0.8 and depth 4-5
suffices. The priors and the truths are in the same coordinates, so this is
the same kind of check, not an easier one.
"""

import arviz as az
import numpy as np
import pytest
import xarray as xr
from helpers import import_benchmark
from scipy.stats import chisquare

import epifit
from epifit.model import loads_model

coverage = import_benchmark("coverage")

PRIORS = {"r": (0.25, 0.25), "gamma": (0.25, 0.2)}  # log-normal: median, sdlog
CALIBRATED, OVERDISPERSED = 50, 25  # datasets
DAYS = 30
DISPERSION = 10.0  # negative binomial size: variance mu (1 + mu / 10)
WARMUP, DRAWS, THIN = 200, 57, 3  # lag-3 autocorrelations measured below 0.05
RANKS = 19  # thinned draws: ranks 0..19, 20 values
BINS = 5  # 4 values a bin; 50 ranks: 10 expected per bin
ALPHA = 0.01
MODEL = f"""
name = "sir_growth_rate"
compartments = ["S", "I", "R"]
[parameters]
N = {{ value = {coverage.POPULATION}, fixed = true }}
X0 = {{ value = {coverage.SEEDED}, fixed = true }}
r = {{ value = 0.25, transform = "softplus", per_patch = true }}
gamma = {{ value = 0.25, transform = "softplus", per_patch = true }}
[[infections]]
from = "S"
to = "I"
transmission = "r + gamma"
infectious = ["I"]
normalize = "population"
population = "N"
[[transitions]]
from = "I"
to = "R"
rate = "gamma"
[initial]
S = "N - X0"
I = "X0"
[[observations]]
name = "cases"
kind = "flow"
transition = "S->I"
family = "poisson"
"""
FIT = {
    "rtol": 1e-6,
    "atol": 1e-6,
    # the MAP is only the chain's start: a short L-BFGS run, no Laplace
    # approximation (its Hessian's compile would cost more than the warm-up);
    # starting from the priors' medians instead (`sample(values={})`) was
    # slower: the warm-up then starts far from 75 posteriors at once
    "tolerance": 1e-5,
    "phases": [{"method": "lbfgs", "iterations": 200}],
    "uncertainty": {"method": "none"},
    "parameters": {
        p: {"prior": {"family": "lognormal", "median": m, "sdlog": s}}
        for p, (m, s) in PRIORS.items()
    },
}


def _datasets(rng) -> tuple[xr.Dataset, dict[str, np.ndarray]]:
    """Truths from the prior; Poisson counts for the first `CALIBRATED`
    patches, negative binomial ones (the same mean) for the rest."""
    n = CALIBRATED + OVERDISPERSED
    truths = {p: m * np.exp(s * rng.standard_normal(n)) for p, (m, s) in PRIORS.items()}
    beta = truths["r"] + truths["gamma"]
    mu = np.stack(
        [
            coverage.incidence("sir", {"beta": b, "gamma": g}, DAYS)
            for b, g in zip(beta, truths["gamma"], strict=True)
        ],
        axis=1,
    )  # (time, patch); day 0 NaN
    m = np.nan_to_num(mu)
    y = rng.poisson(m).astype(float)
    k = DISPERSION
    y[:, CALIBRATED:] = rng.negative_binomial(k, k / (k + m[:, CALIBRATED:]))
    y[np.isnan(mu)] = np.nan
    dates = np.datetime64("2020-03-01") + np.arange(DAYS).astype("timedelta64[D]")
    ds = xr.Dataset(
        {"cases": (("time", "patch"), y)},
        coords={"time": dates, "patch": [f"d{i:03d}" for i in range(n)]},
    )
    return ds, truths


@pytest.fixture(scope="module")
def sbc():
    """One chain over all 75 datasets; per parameter and group of datasets,
    the ranks of the truths among the thinned draws, and the diagnostics."""
    ds, truths = _datasets(np.random.default_rng(2024))
    spec = loads_model(MODEL, path="sir_growth_rate.toml")
    fit = epifit.calibrate(spec, ds, fit=FIT, progress=False)
    post = epifit.sample(init=fit, chains=1, warmup=WARMUP, draws=DRAWS, seed=1,
                         chunk=DRAWS, progress=False)  # fmt: skip
    posterior = post.data.posterior
    ranks = {}
    for p, truth in truths.items():
        thinned = posterior[p].values[0, ::THIN][:RANKS]  # (RANKS, patch)
        assert thinned.shape[0] == RANKS
        ranks[p] = (thinned < truth[None, :]).sum(axis=0)
    # one chain: split R-hat over its two halves, and the ESS of all its draws
    half = DRAWS // 2
    halves = xr.Dataset(
        {
            p: (("chain", "draw", "patch"), v[0, : 2 * half].reshape(2, half, -1))
            for p, v in ((p, posterior[p].values) for p in truths)
        }
    )
    stats = post.data.sample_stats
    groups = {
        "calibrated": slice(0, CALIBRATED),
        "overdispersed": slice(CALIBRATED, None),
    }
    diagnostics = {
        "divergences": int(stats["diverging"].sum()),
        "tree_depth_max": int(stats["tree_depth"].max()),
    }
    for g, patches in groups.items():
        part = posterior[list(PRIORS)].isel(patch=patches)
        diagnostics[g] = {
            "split_r_hat_max": float(
                az.rhat(halves.isel(patch=patches)).to_array().max()
            ),
            "ess_bulk_min": float(az.ess(part, method="bulk").to_array().min()),
            "ess_tail_min": float(az.ess(part, method="tail").to_array().min()),
        }
    return ranks, diagnostics


def _uniformity(ranks: np.ndarray) -> tuple[list[int], float]:
    counts = np.histogram(ranks, bins=BINS, range=(0, RANKS + 1))[0]
    return counts.tolist(), float(chisquare(counts).pvalue)


@pytest.mark.slow
def test_ranks_of_the_truth_among_posterior_draws_are_uniform(sbc):
    """Each parameter's 50 ranks pass the chi-square test (5 bins, 10 expected
    in each); the two are tested apart, since a dataset's two ranks are
    correlated (as its posterior is)."""
    ranks, diagnostics = sbc
    for p, r in ranks.items():
        counts, pvalue = _uniformity(r[:CALIBRATED])
        assert pvalue > ALPHA, (p, counts, pvalue, diagnostics)


@pytest.mark.slow
def test_overconfident_posteriors_fail_the_uniformity_test(sbc):
    """The counts are overdispersed, the likelihood Poisson: the posteriors
    are too narrow and the truths fall in the tails of the draws. The 50 ranks
    of the 25 datasets' two parameters, pooled (5 bins, 10 expected in each),
    fail the test."""
    ranks, diagnostics = sbc
    pooled = np.concatenate([r[CALIBRATED:] for r in ranks.values()])
    counts, pvalue = _uniformity(pooled)
    apart = {p: _uniformity(r[CALIBRATED:]) for p, r in ranks.items()}
    assert pvalue < ALPHA, (counts, pvalue, apart, diagnostics)
