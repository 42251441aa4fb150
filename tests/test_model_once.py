"""`computed_once`: the same values and derivatives as the expression it wraps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from epifit.model._once import computed_once


def _force(i, w, cols, beta):
    return beta * (i + 2.0 * jnp.sum(w * i[cols], axis=-1))


@pytest.fixture
def operands():
    rng = np.random.default_rng(0)
    n, k = 12, 3
    return (
        jnp.asarray(rng.uniform(0, 1, n)),
        jnp.asarray(rng.uniform(0, 0.1, (n, k))),
        jnp.asarray(rng.integers(0, n, (n, k)), jnp.int32),
        jnp.asarray(rng.uniform(0.2, 0.5, n)),
    )


def _both(t, i, w, cols, beta):
    # read twice, as S and E read the force of infection
    lam = computed_once(_force, t, i, w, cols, beta)
    return jnp.concatenate([-lam * i, lam * i - 0.3 * i])


def _direct(t, i, w, cols, beta):
    lam = _force(i, w, cols, beta)
    return jnp.concatenate([-lam * i, lam * i - 0.3 * i])


def test_value_jvp_and_grad_match_the_plain_expression(operands):
    i, w, cols, beta = operands
    t = jnp.asarray(2.5)
    np.testing.assert_allclose(
        jax.jit(_both)(t, *operands), _direct(t, *operands), rtol=1e-14
    )

    def scalar(f):
        return lambda i, w, beta: jnp.sum(jnp.sin(f(t, i, w, cols, beta)))

    g1 = jax.jit(jax.grad(scalar(_both), argnums=(0, 1, 2)))(i, w, beta)
    g2 = jax.jit(jax.grad(scalar(_direct), argnums=(0, 1, 2)))(i, w, beta)
    # float64; only the order of the sums differs between the two programs
    for a, b in zip(g1, g2, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-18)
    d = jnp.ones_like(i)
    _, j1 = jax.jvp(lambda x: _both(t, x, w, cols, beta), (i,), (d,))
    _, j2 = jax.jvp(lambda x: _direct(t, x, w, cols, beta), (i,), (d,))
    np.testing.assert_allclose(j1, j2, rtol=1e-12)


def test_under_vmap_with_batched_time(operands):
    i, w, cols, beta = operands
    ts = jnp.array([0.0, 1.0, 7.5])
    scales = jnp.array([1.0, 0.5, 2.0])
    out = jax.jit(jax.vmap(lambda t, s: _both(t, s * i, w, cols, beta)))(ts, scales)
    for k in range(3):
        np.testing.assert_allclose(
            out[k], _direct(ts[k], scales[k] * i, w, cols, beta), rtol=1e-14
        )


def test_a_nan_time_gives_nan_not_a_stale_value(operands):
    out = jax.jit(lambda t: computed_once(_force, t, *operands))(jnp.nan)
    assert np.all(np.isnan(out))


def _loops(model, n, cov):
    params = model.init_params(n)
    y0 = model.initial_state(params, cov, n)
    args, inputs = model.precompute(params, cov, n)
    jaxpr = jax.make_jaxpr(model.vector_field)(0.5, y0, args, inputs)
    return str(jaxpr).count(" while[")


@pytest.mark.parametrize(
    ("n", "sparse", "loops"),
    [(3, False, 0), (48, False, 1), (64, True, 0), (280, True, 1)],
)
def test_only_a_large_coupling_product_is_computed_once(n, sparse, loops):
    """The vector field computes its coupling product once into its own buffer
    (a one-trip loop) only where the product costs at least `ONCE_MIN_WORK`
    multiply-adds (48 x 48 dense, 280 x 8 sparse); a smaller one is cheaper
    computed where it is read, and a model without coupling has none."""
    from pathlib import Path

    import epifit.model as em
    from epifit.model._coupling import ONCE_MIN_WORK

    text = Path("models/seir_age3.toml").read_text()
    text = text.replace("value = [1.0, 1.0, 1.0]", "value = 1.0")
    model = em.compile_model(em.loads_model(text))
    rng = np.random.default_rng(1)
    k = 8
    contacts = np.zeros((n, n))
    for p in range(n):
        contacts[p, rng.choice(n, size=min(k, n), replace=False)] = 1.0
    cov = {
        "population": jnp.asarray(rng.uniform(1e5, 1e6, n)),
        "contacts": em.sparse_coupling(contacts) if sparse else jnp.asarray(contacts),
    }
    work = n * k if sparse else n * n
    assert (work >= ONCE_MIN_WORK) == bool(loops)
    assert _loops(model, n, cov) == loops
    plain = em.compile_model(em.load_model("models/seird_boxcar.toml"))
    assert _loops(plain, n, {}) == 0
