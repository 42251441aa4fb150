"""Observation models, delays and reporting, against SciPy and NumPy."""

import jax

jax.config.update("jax_enable_x64", True)

import functools as ft  # noqa: E402

import equinox as eqx  # noqa: E402
import hypothesis.strategies as st  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import scipy.stats  # noqa: E402
from hypothesis import given, settings  # noqa: E402

from epifit.data import (  # noqa: E402
    AbstractDelay,
    AbstractObservationModel,
    GammaDelay,
    Gaussian,
    LogNormalDelay,
    NegativeBinomial,
    Poisson,
    ascertain,
    convolve_delay,
    expected_reports,
    incidence,
    normalize_week_effect,
    prevalence,
    week_effect,
)

RTOL = 1e-10  # float64 sums of O(100) terms of size O(10)


def _counts(rng, shape, mean=20.0):
    predicted = rng.gamma(2.0, mean / 2.0, shape) + 1e-3
    observed = rng.poisson(predicted).astype(float)
    return predicted, observed


# ---------------------------------------------------------- against scipy.stats


@pytest.mark.parametrize("seed", range(5))
def test_gaussian_matches_scipy_norm(seed):
    rng = np.random.default_rng(seed)
    predicted, observed = rng.normal(size=(2, 30, 4)) * 10
    sigma = rng.uniform(0.1, 5.0)
    expected = scipy.stats.norm.logpdf(observed, loc=predicted, scale=sigma).sum()
    ll = Gaussian(sigma).log_likelihood(predicted, observed)
    np.testing.assert_allclose(ll, expected, rtol=RTOL)
    # Per-point standard deviations (weighted least squares).
    sigmas = rng.uniform(0.1, 5.0, size=(30, 4))
    expected = scipy.stats.norm.logpdf(observed, loc=predicted, scale=sigmas).sum()
    np.testing.assert_allclose(
        Gaussian(sigmas).log_likelihood(predicted, observed), expected, rtol=RTOL
    )


@pytest.mark.parametrize("seed", range(5))
def test_poisson_matches_scipy(seed):
    rng = np.random.default_rng(seed)
    predicted, observed = _counts(rng, (40, 3))
    observed[0, 0] = 0.0
    expected = scipy.stats.poisson.logpmf(observed, predicted).sum()
    np.testing.assert_allclose(
        Poisson().log_likelihood(predicted, observed), expected, rtol=RTOL
    )
    np.testing.assert_allclose(
        Poisson().loss(predicted, observed), -expected, rtol=RTOL
    )


def test_poisson_and_negative_binomial_weights_scale_the_loss():
    """`weight` multiplies the loss (the negative log-likelihood), as
    Gaussian's does its sum of squares; the log-likelihood is unweighted."""
    rng = np.random.default_rng(0)
    predicted, observed = _counts(rng, (30, 2))
    poisson = scipy.stats.poisson.logpmf(observed, predicted).sum()
    phi = 3.0
    nbinom = scipy.stats.nbinom.logpmf(observed, phi, phi / (phi + predicted)).sum()
    for model, ll in (
        (Poisson(weight=2.5), poisson),
        (NegativeBinomial(phi, weight=2.5), nbinom),
    ):
        np.testing.assert_allclose(
            model.loss(predicted, observed), -2.5 * ll, rtol=RTOL
        )
        np.testing.assert_allclose(
            model.log_likelihood(predicted, observed), ll, rtol=RTOL
        )
    assert Poisson().weight == NegativeBinomial(phi).weight == 1.0


@pytest.mark.parametrize("seed", range(5))
def test_negative_binomial_matches_scipy(seed):
    rng = np.random.default_rng(seed)
    predicted, observed = _counts(rng, (40, 3))
    observed[0, 0] = 0.0
    phi = rng.uniform(0.3, 50.0)
    # SciPy's nbinom(n, p) has mean n(1-p)/p: n = phi, p = phi / (phi + mean).
    expected = scipy.stats.nbinom.logpmf(observed, phi, phi / (phi + predicted)).sum()
    np.testing.assert_allclose(
        NegativeBinomial(phi).log_likelihood(predicted, observed), expected, rtol=RTOL
    )
    np.testing.assert_allclose(
        NegativeBinomial(phi).loss(predicted, observed), -expected, rtol=RTOL
    )


def test_negative_binomial_parametrisation_moments():
    """The mapping used above really is mean `mu`, variance `mu + mu^2 / phi`."""
    mu, phi = 12.5, 3.0
    dist = scipy.stats.nbinom(phi, phi / (phi + mu))
    np.testing.assert_allclose(dist.mean(), mu, rtol=1e-12)
    np.testing.assert_allclose(dist.var(), mu + mu**2 / phi, rtol=1e-12)
    # And the likelihood's own moments, by summing over the support.
    k = np.arange(2000.0)
    pmf = np.exp(
        [
            float(NegativeBinomial(phi).log_likelihood(jnp.array([mu]), jnp.array([x])))
            for x in k[:300]
        ]
    )
    np.testing.assert_allclose(pmf.sum(), 1.0, atol=1e-10)
    np.testing.assert_allclose((k[:300] * pmf).sum(), mu, rtol=1e-9)
    np.testing.assert_allclose(
        ((k[:300] - mu) ** 2 * pmf).sum(), mu + mu**2 / phi, rtol=1e-9
    )


def test_negative_binomial_tends_to_poisson():
    rng = np.random.default_rng(3)
    predicted, observed = _counts(rng, (20,))
    nb = NegativeBinomial(1e8).log_likelihood(predicted, observed)
    po = Poisson().log_likelihood(predicted, observed)
    np.testing.assert_allclose(nb, po, rtol=1e-5)  # O(mu / phi) apart


@settings(max_examples=30, deadline=None)
@given(
    mu=st.floats(1e-3, 1e4),
    k=st.integers(0, 10_000),
    phi=st.floats(1e-2, 1e3),
    sigma=st.floats(1e-2, 1e3),
)
def test_single_points_match_scipy(mu, k, phi, sigma):
    p, o = jnp.array([mu]), jnp.array([float(k)])
    np.testing.assert_allclose(
        Poisson().log_likelihood(p, o), scipy.stats.poisson.logpmf(k, mu), rtol=1e-8
    )
    np.testing.assert_allclose(
        NegativeBinomial(phi).log_likelihood(p, o),
        scipy.stats.nbinom.logpmf(k, phi, phi / (phi + mu)),
        rtol=1e-8,
        atol=1e-8,
    )
    np.testing.assert_allclose(
        Gaussian(sigma).log_likelihood(p, o),
        scipy.stats.norm.logpdf(k, mu, sigma),
        rtol=1e-8,
    )


def test_gradients_match_closed_forms():
    rng = np.random.default_rng(7)
    predicted, observed = _counts(rng, (25,))
    phi = 4.0
    g = jax.grad(Poisson().log_likelihood)(jnp.asarray(predicted), observed)
    np.testing.assert_allclose(g, observed / predicted - 1.0, rtol=1e-12)
    g = jax.grad(NegativeBinomial(phi).log_likelihood)(jnp.asarray(predicted), observed)
    np.testing.assert_allclose(
        g, observed / predicted - (observed + phi) / (phi + predicted), rtol=1e-12
    )
    g = jax.grad(Gaussian(2.0).log_likelihood)(jnp.asarray(predicted), observed)
    np.testing.assert_allclose(g, (observed - predicted) / 4.0, rtol=1e-12)


def test_poisson_zero_mean_zero_count_is_finite():
    ll, g = jax.value_and_grad(Poisson().log_likelihood)(jnp.zeros(2), jnp.zeros(2))
    assert ll == 0.0  # P(0 | mean 0) = 1
    np.testing.assert_array_equal(g, [-1.0, -1.0])


# ------------------------------------------------------------ least squares


def test_gaussian_weight_and_sigma_are_one_family():
    rng = np.random.default_rng(1)
    predicted, observed = rng.normal(size=(2, 50))
    weight = 20000.0
    by_weight, by_sigma = Gaussian(weight=weight), Gaussian(sigma=(2 * weight) ** -0.5)
    np.testing.assert_allclose(by_weight.sigma, (2 * weight) ** -0.5, rtol=1e-14)
    loss = by_weight.loss(predicted, observed)
    np.testing.assert_allclose(
        loss, weight * np.sum((predicted - observed) ** 2), rtol=1e-14
    )
    np.testing.assert_allclose(by_sigma.loss(predicted, observed), loss, rtol=1e-12)
    constant = 50 * 0.5 * np.log(weight / np.pi)  # what the loss leaves out
    np.testing.assert_allclose(
        by_sigma.log_likelihood(predicted, observed), -loss + constant, rtol=1e-12
    )


def test_reference_problem_loss():
    """The posted metapopulation loss: weight 1 on new infections, 20000 on deaths."""
    rng = np.random.default_rng(2)
    n_time, n_patch = 12, 5
    s = 1.0 - np.cumsum(rng.uniform(0, 0.01, (n_time, n_patch)), axis=0)
    d = np.cumsum(rng.uniform(0, 1e-4, (n_time, n_patch)), axis=0)
    data = rng.uniform(0, 0.01, (n_time - 1, 2, n_patch))
    expected = np.sum(
        (np.diff(1 - s, axis=0) - data[:, 0]) ** 2
        + 20000 * (np.diff(d, axis=0) - data[:, 1]) ** 2
    )
    loss = Gaussian(weight=1.0).loss(incidence(1 - s), data[:, 0]) + Gaussian(
        weight=20000.0
    ).loss(incidence(d), data[:, 1])
    np.testing.assert_allclose(loss, expected, rtol=1e-12)


# ------------------------------------------------------------------- masking

FAMILIES = [
    Gaussian(1.7),
    Gaussian(weight=np.linspace(1, 2, 24).reshape(8, 3)),
    Poisson(),
    NegativeBinomial(2.5),
]


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: type(f).__name__)
@pytest.mark.parametrize("seed", range(2))
def test_masking_removes_points_from_value_and_gradient(family, seed):
    rng = np.random.default_rng(seed)
    predicted, observed = _counts(rng, (8, 3))
    mask = rng.uniform(size=(8, 3)) < 0.6
    mask[0, 0], mask[1, 1] = True, False
    observed_nan = np.where(mask, observed, np.nan)  # missing data, as in a dataset
    predicted_bad = np.where(mask, predicted, np.nan)  # even nonsense predictions
    # The reference: the same computation with the masked points deleted.
    kept = family
    if isinstance(family, Gaussian) and np.ndim(family.weight):
        kept = Gaussian(weight=np.asarray(family.weight)[mask])

    @jax.jit
    @ft.partial(jax.value_and_grad, argnums=(0, 1))
    def masked(p, fam):
        return fam.log_likelihood(p, observed_nan, mask)

    @jax.jit
    @ft.partial(jax.value_and_grad, argnums=(0, 1))
    def deleted(p, fam):
        return fam.log_likelihood(p, observed[mask])

    value, (grad_p, grad_f) = masked(predicted_bad, family)
    ref_value, (ref_grad_p, ref_grad_f) = deleted(predicted[mask], kept)
    np.testing.assert_allclose(value, ref_value, rtol=1e-12)
    assert np.all(np.isfinite(grad_p))
    np.testing.assert_array_equal(grad_p[~mask], 0.0)  # exactly nothing
    np.testing.assert_allclose(grad_p[mask], ref_grad_p, rtol=1e-12)
    for leaf, ref_leaf in zip(
        jax.tree.leaves(grad_f), jax.tree.leaves(ref_grad_f), strict=True
    ):
        if np.ndim(leaf):  # per-point weights: masked entries get exactly 0
            np.testing.assert_array_equal(np.asarray(leaf)[~mask], 0.0)
            np.testing.assert_allclose(np.asarray(leaf)[mask], ref_leaf, rtol=1e-12)
        else:
            np.testing.assert_allclose(leaf, ref_leaf, rtol=1e-12)
    # The loss form obeys the same rule.
    g = jax.jit(jax.grad(lambda p: family.loss(p, observed_nan, mask)))(predicted_bad)
    assert np.all(np.isfinite(g)) and np.all(g[~mask] == 0.0)


@pytest.mark.parametrize(
    "family", FAMILIES[:1] + FAMILIES[2:], ids=lambda f: type(f).__name__
)
def test_nan_observations_are_missing_without_a_mask(family):
    rng = np.random.default_rng(4)
    predicted, observed = _counts(rng, (10,))
    observed[[2, 5]] = np.nan
    keep = ~np.isnan(observed)
    ll, g = jax.value_and_grad(family.log_likelihood)(jnp.asarray(predicted), observed)
    np.testing.assert_allclose(
        ll, family.log_likelihood(predicted[keep], observed[keep]), rtol=1e-12
    )
    np.testing.assert_array_equal(g[~keep], 0.0)


def test_all_masked_is_zero():
    p, o = jnp.ones(4), jnp.full(4, jnp.nan)
    for family in (Gaussian(1.0), Poisson(), NegativeBinomial(1.0)):
        assert family.log_likelihood(p, o) == 0.0
        np.testing.assert_array_equal(jax.grad(family.log_likelihood)(p, o), 0.0)


def test_jit_and_traced_parameters():
    rng = np.random.default_rng(5)
    predicted, observed = _counts(rng, (12,))

    @jax.jit
    def nll(log_phi, p):
        return NegativeBinomial(jnp.exp(log_phi)).loss(p, observed)

    log_phi = np.log(3.0)
    np.testing.assert_allclose(
        nll(log_phi, predicted),
        -scipy.stats.nbinom.logpmf(observed, 3.0, 3.0 / (3.0 + predicted)).sum(),
        rtol=1e-10,
    )
    g = jax.grad(nll)(log_phi, predicted)
    eps = 1e-6
    fd = (nll(log_phi + eps, predicted) - nll(log_phi - eps, predicted)) / (2 * eps)
    np.testing.assert_allclose(g, fd, rtol=1e-6)


def test_interfaces_are_abstract_or_final():
    with pytest.raises(TypeError):
        AbstractObservationModel()
    with pytest.raises(TypeError):
        AbstractDelay()
    for cls in (Gaussian, Poisson, NegativeBinomial, GammaDelay, LogNormalDelay):
        assert eqx.is_array(jnp.zeros(())) and issubclass(cls, eqx.Module)


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: Gaussian(), ValueError, r"exactly one of sigma .* or weight"),
        (lambda: Gaussian(1.0, weight=1.0), ValueError, r"exactly one of sigma"),
        (
            lambda: Gaussian(-1.0),
            ValueError,
            r"Gaussian\(sigma=...\) must be > 0; got -1.0",
        ),
        (
            lambda: Gaussian(weight=0.0),
            ValueError,
            r"Gaussian\(weight=...\) must be > 0",
        ),
        (
            lambda: NegativeBinomial(0.0),
            ValueError,
            r"NegativeBinomial\(dispersion=...\) must be > 0",
        ),
        (lambda: NegativeBinomial("big"), TypeError, r"must be a real number"),
        (
            lambda: Poisson(weight=0.0),
            ValueError,
            r"Poisson\(weight=...\) must be > 0",
        ),
        (
            lambda: NegativeBinomial(1.0, weight=-1.0),
            ValueError,
            r"NegativeBinomial\(weight=...\) must be > 0",
        ),
        (
            lambda: GammaDelay(0.0, 1.0, 10),
            ValueError,
            r"GammaDelay\(mean=...\) must be > 0",
        ),
        (
            lambda: LogNormalDelay(5.0, -1.0, 10),
            ValueError,
            r"LogNormalDelay\(sd=...\) must be > 0",
        ),
        (
            lambda: GammaDelay(5.0, 1.0, 2.5),
            ValueError,
            r"max_delay=...\) must be an integer",
        ),
        (
            lambda: GammaDelay(5.0, 1.0, -1),
            ValueError,
            r"max_delay=...\) must be an integer",
        ),
        (
            lambda: Poisson().log_likelihood(jnp.ones(3), jnp.ones(4)),
            ValueError,
            r"predicted has shape \(3,\) but observed has shape \(4,\)",
        ),
        (
            lambda: Poisson().log_likelihood(
                jnp.ones(3), jnp.ones(3), jnp.ones(2, bool)
            ),
            ValueError,
            r"mask has shape \(2,\)",
        ),
        (
            lambda: Poisson().log_likelihood(jnp.ones(3), jnp.ones(3), jnp.ones(3)),
            TypeError,
            r"mask must be boolean",
        ),
    ],
)
def test_construction_and_shape_errors(make, error, message):
    with pytest.raises(error, match=message):
        make()


# -------------------------------------------------------------------- delays

DELAYS = [
    (GammaDelay, 5.0, 2.0),
    (GammaDelay, 2.3, 1.9),
    (GammaDelay, 10.0, 4.0),
    (LogNormalDelay, 5.0, 2.0),
    (LogNormalDelay, 4.1, 3.0),
    (LogNormalDelay, 10.0, 4.0),
]


MAX_DELAY = 40  # one value, so that each family's pmf compiles once


def _scipy_delay(cls, mean, sd):
    if cls is GammaDelay:
        dist = scipy.stats.gamma(a=(mean / sd) ** 2, scale=sd**2 / mean)
    else:
        sigma2 = np.log1p((sd / mean) ** 2)
        dist = scipy.stats.lognorm(
            s=np.sqrt(sigma2), scale=np.exp(np.log(mean) - sigma2 / 2)
        )
    # The parametrisation is by mean and sd, checked by SciPy itself.
    np.testing.assert_allclose([dist.mean(), dist.std()], [mean, sd], rtol=1e-12)
    return dist


@pytest.mark.parametrize(("cls", "mean", "sd"), DELAYS)
def test_delay_pmf_against_scipy_cdf(cls, mean, sd):
    max_delay = MAX_DELAY
    dist = _scipy_delay(cls, mean, sd)
    edges = np.arange(max_delay + 1) + 0.5
    expected = np.diff(dist.cdf(edges), prepend=0.0) / dist.cdf(edges[-1])
    pmf = cls(mean, sd, max_delay).pmf()
    assert pmf.shape == (max_delay + 1,)
    np.testing.assert_allclose(pmf, expected, rtol=1e-9, atol=1e-14)
    np.testing.assert_allclose(pmf.sum(), 1.0, rtol=1e-14)
    assert np.all(pmf >= 0)


@pytest.mark.parametrize(("cls", "mean", "sd"), DELAYS)
def test_delay_mean_and_variance_survive_discretisation(cls, mean, sd):
    dist = _scipy_delay(cls, mean, sd)
    max_delay = MAX_DELAY
    assert dist.sf(max_delay + 0.5) < 1e-4  # truncation shifts the mean < 0.004
    pmf = np.asarray(cls(mean, sd, max_delay).pmf())
    days = np.arange(max_delay + 1)
    discrete_mean = days @ pmf
    discrete_var = (days - discrete_mean) ** 2 @ pmf
    # Rounding to the nearest day: mean kept, variance + 1/12 (Sheppard), up to
    # an error set by the density near 0, a few hundredths for these shapes.
    assert abs(discrete_mean - mean) < 0.03
    assert abs(discrete_var - (sd**2 + 1 / 12)) < 0.05 * sd**2


@settings(max_examples=25, deadline=None)
@given(
    mean=st.floats(0.5, 20.0),
    cv=st.floats(0.1, 1.5),
    max_delay=st.sampled_from([0, 1, 7, MAX_DELAY]),  # static: one compilation each
    lognormal=st.booleans(),
)
def test_delay_pmf_is_a_distribution(mean, cv, max_delay, lognormal):
    cls = LogNormalDelay if lognormal else GammaDelay
    pmf = np.asarray(cls(mean, cv * mean, max_delay).pmf())
    assert pmf.shape == (max_delay + 1,)
    assert np.all(pmf >= 0) and np.all(np.isfinite(pmf))
    np.testing.assert_allclose(pmf.sum(), 1.0, rtol=1e-12)


@pytest.mark.slow  # compiling the gradient of gammainc in its shape takes ~5 s
def test_delay_is_differentiable_in_mean_and_sd():
    def discrete_mean(mean, sd):
        pmf = GammaDelay(mean, sd, 60).pmf()
        return jnp.arange(61) @ pmf

    d_mean, d_sd = jax.jit(jax.grad(discrete_mean, argnums=(0, 1)))(6.0, 2.5)
    np.testing.assert_allclose(d_mean, 1.0, atol=0.02)  # the mean moves with `mean`
    np.testing.assert_allclose(d_sd, 0.0, atol=0.02)  # ... and not with `sd`
    d_mean, _ = jax.grad(
        lambda m, s: jnp.arange(61) @ LogNormalDelay(m, s, 60).pmf(), argnums=(0, 1)
    )(6.0, 2.5)
    np.testing.assert_allclose(d_mean, 1.0, atol=0.02)


@settings(max_examples=30, deadline=None)
@given(
    n_time=st.integers(1, 30),
    n_delay=st.integers(1, 12),
    n_patch=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_convolution_matches_numpy(n_time, n_delay, n_patch, seed):
    rng = np.random.default_rng(seed)
    pmf = rng.dirichlet(np.ones(n_delay))
    shape = (n_time,) if n_patch == 0 else (n_time, n_patch)
    x = rng.uniform(0, 100, shape)
    got = np.asarray(convolve_delay(x, pmf))
    assert got.shape == shape
    columns = x.reshape(n_time, -1).T
    expected = np.stack([np.convolve(c, pmf)[:n_time] for c in columns], axis=-1)
    np.testing.assert_allclose(got, expected.reshape(shape), rtol=1e-12, atol=1e-12)


def test_convolution_with_a_delay_object_and_gradient():
    delay = LogNormalDelay(4.0, 2.0, 15)
    x = np.random.default_rng(0).uniform(0, 50, 40)
    np.testing.assert_allclose(
        convolve_delay(x, delay), np.convolve(x, delay.pmf())[:40], rtol=1e-12
    )
    # d(sum of reports)/d(incidence[t]) = the delay mass still inside the window.
    g = jax.jit(jax.grad(lambda y: convolve_delay(y, delay).sum()))(x)
    pmf = np.asarray(delay.pmf())
    expected = [pmf[: 40 - t].sum() for t in range(40)]
    np.testing.assert_allclose(g, expected, rtol=1e-12)


# ---------------------------------------------------------------- reporting


def test_incidence_is_daily_differences():
    cumulative = np.cumsum(np.random.default_rng(0).uniform(size=(9, 4)), axis=0)
    np.testing.assert_allclose(incidence(cumulative), np.diff(cumulative, axis=0))
    new = incidence(cumulative, initial=np.zeros(4))
    np.testing.assert_allclose(new, np.diff(cumulative, axis=0, prepend=0.0))
    np.testing.assert_allclose(new.sum(axis=0), cumulative[-1])


def test_prevalence_sums_compartments():
    a, b = np.random.default_rng(0).uniform(size=(2, 5, 3))
    np.testing.assert_allclose(prevalence(a), a)
    np.testing.assert_allclose(prevalence(a, b), a + b)
    with pytest.raises(ValueError, match="one shape"):
        prevalence(a, b[:2])


def test_ascertainment_constant_and_time_varying():
    x = np.random.default_rng(0).uniform(size=(6, 3))
    np.testing.assert_allclose(ascertain(x, 0.3), 0.3 * x)
    by_day = np.linspace(0.1, 0.6, 6)
    np.testing.assert_allclose(ascertain(x, by_day), x * by_day[:, None])
    by_patch = np.array([[0.2, 0.5, 0.9]])
    np.testing.assert_allclose(ascertain(x, by_patch), x * by_patch)
    np.testing.assert_allclose(ascertain(x, x), x * x)
    with pytest.raises(ValueError, match=r"shape \(5,\), which does not line up"):
        ascertain(x, np.ones(5))


def test_week_effect():
    effects = np.array([1.4, 1.2, 1.0, 1.0, 0.9, 0.4, 0.3])
    normalized = np.asarray(normalize_week_effect(effects))
    np.testing.assert_allclose(normalized.mean(), 1.0, rtol=1e-14)
    np.testing.assert_allclose(normalized, effects / effects.mean(), rtol=1e-14)
    days = (np.arange(21) + 6) % 7  # starting on a Sunday
    flat = np.full((21, 2), 10.0)
    reported = np.asarray(week_effect(flat, effects, days))
    np.testing.assert_allclose(reported[:, 0], 10.0 * normalized[days])
    # Constant incidence: every full week reports the same total as without it.
    np.testing.assert_allclose(reported.reshape(3, 7, 2).sum(axis=1), 70.0)
    with pytest.raises(ValueError, match="7 multipliers"):
        normalize_week_effect(np.ones(6))
    with pytest.raises(ValueError, match="one entry per day"):
        week_effect(flat, effects, days[:5])


def test_expected_reports_composes_in_order():
    rng = np.random.default_rng(1)
    infections = rng.uniform(0, 100, (30, 2))
    delay = LogNormalDelay(6.0, 3.0, 20)
    fraction = np.linspace(0.2, 0.4, 30)
    effects = rng.uniform(0.5, 1.5, 7)
    days = np.arange(30) % 7
    pmf = np.asarray(delay.pmf())
    expected = np.stack([np.convolve(c, pmf)[:30] for c in infections.T], axis=-1)
    expected *= fraction[:, None] * (effects / effects.mean())[days][:, None]
    got = expected_reports(
        infections, delay=delay, ascertainment=fraction, effects=effects, weekday=days
    )
    np.testing.assert_allclose(got, expected, rtol=1e-12)
    np.testing.assert_allclose(expected_reports(infections), infections)
    with pytest.raises(ValueError, match="needs weekday"):
        expected_reports(infections, effects=effects)
