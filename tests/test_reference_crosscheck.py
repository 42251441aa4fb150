"""The in-repo reference (`benchmarks/reference/`) against the external one
(`../shared/bench/seed_metapop.py` and `peers.py`), when that is present: the
same synthetic problem to the bit, the same model, loss and gradient values,
and each peer configuration the same loss as the external runner's peer of
that name. Skipped, saying so, where the external files are absent (a clone):
the benchmarks and the other reference tests need only the in-repo one."""

from __future__ import annotations

import types

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

SIZES = [(12, 15, 0), (30, 25, 2)]  # (patches, days, seed)
N, DAYS = 5, 8  # the peers' solves: small, they compile every configuration twice
# float64 throughout; the two implementations may order a reduction or a
# matrix product differently (~1e-16 each), far inside these
RTOL = 1e-12
# an adaptive solve repeats that rounding over its steps (measured: at most
# 1e-14 relative on the loss at 6 patches, 10 days)
SOLVE_RTOL = 1e-10


@pytest.fixture(scope="module")
def shared():
    return helpers.import_shared("seed_metapop")


@pytest.fixture(scope="module")
def ours():
    return helpers.reference_problem()


def _external(fn):
    """The external reference adds a (7,) bias to (1, 7) rows: trace it with
    NumPy broadcasting (the suite otherwise raises on rank promotion)."""

    def wrapped(*args):
        with jax.numpy_rank_promotion("allow"):
            return fn(*args)

    return wrapped


@pytest.mark.parametrize("size", SIZES, ids=lambda s: "x".join(map(str, s)))
def test_same_problem_to_the_bit(shared, ours, size):
    n, days, seed = size
    theirs = shared.make_problem(n, days, seed)
    mine = ours.make_problem(n, days, seed)
    assert mine.keys() == theirs.keys()
    for key, value in theirs.items():
        np.testing.assert_array_equal(mine[key], value, err_msg=key)
    assert (ours.LAYERS, ours.N_MLP) == (shared.LAYERS, shared.N_MLP)
    assert ours.STATE_ROWS == shared.STATE_NAMES


def _point(rng, n, days):
    """A susceptible-heavy state, a time (the clamped ends included) and a
    cotangent of du/dt."""
    u = rng.uniform(0.0, 1.0, size=(16, n))
    u[0] = rng.uniform(0.5, 1.0, size=n)
    t = rng.uniform(-0.3, days - 0.7)
    return jnp.asarray(u), jnp.asarray(t), jnp.asarray(rng.normal(size=(16, n)))


def test_same_model_loss_and_gradients(shared, ours):
    """Vector field, transmission rate and loss, and their gradients in the
    parameters, the state and the solution, at random points."""
    P = ours.make_problem(12, 15, 0)
    p = jnp.asarray(P["p_init"])
    mob, cpl = jnp.asarray(P["mobility"]), jnp.asarray(P["coupling"])
    sol, data = jnp.asarray(P["sol_true"]), jnp.asarray(P["data"])

    def field_and_pullback(f):
        """du/dt and its pullback of a cotangent `w` to `(p, u)`, compiled."""

        def fn(p, u, t, w):
            du, vjp = jax.vjp(lambda p, u: f(u, t, p, mob, cpl), p, u)
            return du, vjp(w)

        return jax.jit(fn)

    rng = np.random.default_rng(0)
    points = [_point(rng, 12, 15) for _ in range(5)]
    mine = field_and_pullback(ours.vector_field)
    with jax.numpy_rank_promotion("allow"):  # traced here, run below
        theirs = field_and_pullback(shared.SEIRD_mobility_coupled)
        expected = [theirs(p, *point) for point in points]
    for point, (du_x, (gp_x, gu_x)) in zip(points, expected, strict=True):
        du, (gp, gu) = mine(p, *point)
        np.testing.assert_allclose(du, du_x, rtol=RTOL, atol=RTOL * 1e-3)
        for a, b in ((gp, gp_x), (gu, gu_x)):
            np.testing.assert_allclose(a, b, rtol=RTOL, atol=RTOL * np.abs(b).max())
    x = mob[..., 3]
    np.testing.assert_allclose(
        ours.transmission_rate(p[15:], x),
        _external(shared.nn_batch)(p[15:], x)[:, 0, 0],
        rtol=RTOL,
    )
    perturbed = sol * (1 + 0.01 * jnp.asarray(rng.normal(size=sol.shape)))
    for s in (sol, perturbed):
        value, grad = jax.value_and_grad(ours.loss_from_solution)(s, data)
        value_x, grad_x = _external(jax.value_and_grad(shared.loss_from_solution))(
            s, data
        )
        np.testing.assert_allclose(value, value_x, rtol=RTOL)
        np.testing.assert_allclose(grad, grad_x, rtol=RTOL, atol=0)
    rates = ours.numpy_transmission_rate(P["p_init"][15:], P["mobility"])
    np.testing.assert_array_equal(
        rates, shared._np_beta_all_days(P["p_init"][15:], P["mobility"])
    )


def _shared_loss(name, mobility, coupling):
    """The external runner's loss for its peer `name`, with its settings."""
    sm = helpers.import_shared("seed_metapop")
    runner = helpers.import_shared("peers")
    tight = name == "reference"  # the runner's --peer reference settings
    ns = types.SimpleNamespace(
        rtol=1e-8 if tight else 1e-3,
        atol=1e-12 if tight else 1e-6,
        T=DAYS,
        max_steps=200_000 if tight else 4096,
        x64=True,
    )

    def make_vf(count, pytree=False):
        return sm.SEIRD_mobility_coupled_tuple if pytree else sm.SEIRD_mobility_coupled

    build = runner.build_peer
    loss_builder, _ = build(name, ns, sm, make_vf, jax, jnp, np, mobility, coupling)
    return loss_builder(count=False)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        "diffrax-tsit5",
        "diffrax-tsit5-backsolve",
        "diffrax-tsit5-pytree-bounded",
        "odeint",
        "odeint-closure",
        "reference",
    ],
)
def test_peer_computes_the_shared_runners_loss(ours, shared, name):
    """Each configuration's loss (and, for diffrax's default and the reference,
    its gradient) at `p_init`, against the external runner's peer."""
    peers = helpers.import_benchmark("reference.peers")
    a = peers.arguments(ours.make_problem(N, DAYS, 0), jnp.float64)
    mine = peers.build(name, a[3], a[4]).loss
    theirs = _external(jax.jit(_shared_loss(name, a[3], a[4])))
    value, value_x = jax.jit(mine)(*a), theirs(*a)
    assert np.isfinite(value) and value > 0
    np.testing.assert_allclose(value, value_x, rtol=SOLVE_RTOL)
    if name in ("diffrax-tsit5", "reference"):
        g = jax.jit(jax.grad(mine))(*a)
        g_x = _external(jax.jit(jax.grad(_shared_loss(name, a[3], a[4]))))(*a)
        atol = SOLVE_RTOL * np.abs(g_x).max()
        np.testing.assert_allclose(g, g_x, rtol=SOLVE_RTOL, atol=atol)
