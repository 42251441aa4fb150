"""The coverage study of `benchmarks/coverage.py`, small: the joint fit of
independent datasets as patches is each dataset's own fit, and the Laplace
intervals of a Poisson SIR cover truths drawn from the prior at their
nominal rates."""

import numpy as np
import pytest
from helpers import import_benchmark

import epifit
from epifit.model import loads_model

coverage = import_benchmark("coverage")


def test_generated_models_load_and_match_the_generator():
    """The benchmark's model files load, and epifit's solution of them is the
    SciPy generator's expected incidence (so truths mean the same to both)."""
    rng = np.random.default_rng(1)
    for name in coverage.MODELS:
        spec = loads_model(coverage.model_toml(name), path=f"{name}.toml")
        truths = coverage.draw_truths(name, 2, rng)
        ds = coverage.datasets(name, truths, 30, rng)
        values = {p: v for p, v in truths.items()}
        sim = epifit.simulate(spec, ds, values=values, rtol=1e-10, atol=1e-10)
        for i in range(2):
            want = coverage.incidence(name, {p: v[i] for p, v in truths.items()}, 30)
            got = sim["predicted_cases"].isel(patch=i).values
            np.testing.assert_allclose(got[1:], want[1:], rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_joint_fit_is_each_datasets_own_fit():
    """Fitted as patches of one problem (no coupling), every dataset gets the
    estimates and intervals of its own separate fit."""
    rng = np.random.default_rng(7)
    truths = coverage.draw_truths("sir", 3, rng)
    ds = coverage.datasets("sir", truths, 40, rng)
    spec = loads_model(coverage.model_toml("sir"), path="sir.toml")
    fit = coverage.fit_config("sir")
    joint = epifit.calibrate(spec, ds, fit=fit, progress=False)
    rows = {r["label"]: r for r in joint.table}
    for i in (0, 2):
        alone = epifit.calibrate(spec, ds.isel(patch=[i]), fit=fit, progress=False)
        own = {r["label"]: r for r in alone.table}
        for p in ("beta", "gamma"):
            a, b = rows[f"{p}[d{i:03d}]"], own[f"{p}[d{i:03d}]"]
            # both stop on the optimiser's tolerances, not at the exact MAP
            assert a["estimate"] == pytest.approx(b["estimate"], rel=1e-5), p
            assert a["lower"] == pytest.approx(b["lower"], rel=1e-4), p
            assert a["upper"] == pytest.approx(b["upper"], rel=1e-4), p


@pytest.mark.slow
def test_laplace_intervals_cover_at_their_nominal_rate():
    """80 Poisson SIR datasets, truths from the prior: the nominal 95% and 50%
    rates lie inside the 99% Clopper-Pearson interval of the measured share
    of intervals containing the truth, for beta and gamma."""
    record = coverage.run("sir", 80, 60, seed=11)
    assert record["converged"], record["message"]
    for p, by_level in record["coverage"].items():
        for level, c in by_level.items():
            lo, hi = coverage.clopper_pearson(c["covered"], 80, alpha=0.01)
            assert lo <= float(level) <= hi, (p, level, c)
