"""Simulation-based calibration of `epifit.sample` (slow): the ranks of the
true parameters among the posterior draws are uniform over datasets whose
parameters are drawn from the prior.

The 50 synthetic Poisson SIR datasets of `benchmarks/coverage.py` are fitted
as the uncoupled patches of one problem (every parameter per patch): the
posterior is the product of the datasets' own posteriors, so one NUTS run
samples all 50 at once."""

import numpy as np
import pytest
from helpers import import_benchmark
from scipy.stats import chisquare

import epifit
from epifit.model import loads_model

coverage = import_benchmark("coverage")
N_DATASETS, THIN, BINS = 50, 3, 10


@pytest.mark.slow
def test_ranks_of_the_truth_among_posterior_draws_are_uniform():
    rng = np.random.default_rng(2024)
    truths = coverage.draw_truths("sir", N_DATASETS, rng)
    ds = coverage.datasets("sir", truths, 40, rng)
    spec = loads_model(coverage.model_toml("sir"), path="sir.toml")
    fit = coverage.fit_config("sir")
    post = epifit.sample(spec, ds, fit=fit, chains=2, warmup=200, draws=300,
                         seed=1, progress=False)  # fmt: skip
    table = post.diagnostics()
    assert table["r_hat"].max() <= 1.02, table["r_hat"].idxmax()
    ranks = []
    for p, truth in truths.items():
        draws = post.data.posterior[p].values[:, ::THIN]  # (chain, draw, patch)
        draws = draws.reshape(-1, N_DATASETS)  # 200 draws per dataset
        ranks.append((draws < truth[None, :]).sum(axis=0))
    ranks = np.concatenate(ranks)  # 100 ranks in 0..200
    counts = np.histogram(ranks, bins=BINS, range=(0, draws.shape[0] + 1))[0]
    assert chisquare(counts).pvalue > 0.01, counts
