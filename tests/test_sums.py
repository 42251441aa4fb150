"""Sums over leading axes as additions (`epifit/ode/_sums.py`) and the error
norm's sum of squares (`epifit/ode/_misc.py`): same values as the reductions
they replace, and no reduction left where they act."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxprs_in_params

from epifit.ode import _sums
from epifit.ode._misc import rms_norm, sum_of_squares
from epifit.ode._solver import _erk


def _reductions_keeping_last(jaxpr):
    """The `reduce_sum`s of a jaxpr (nested ones included) that keep their
    operand's last axis and add up more than one element per result."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive is jax.lax.reduce_sum_p:
            shape = eqn.invars[0].aval.shape
            axes = eqn.params["axes"]
            if len(shape) - 1 not in axes and np.prod([shape[a] for a in axes]) > 1:
                found.append((shape, axes))
        for sub in jaxprs_in_params(eqn.params):
            found += _reductions_keeping_last(sub)
    return found


@pytest.mark.parametrize(
    ("shape", "axes"),
    [
        ((6, 280), (0,)),
        ((6, 7, 280), (0, 1)),
        ((6, 7, 5), (1,)),
        ((3, 4, 2, 5), (0, 2)),
    ],
)
def test_sum_by_additions_is_the_sum(shape, axes):
    x = np.random.default_rng(0).standard_normal(shape)
    got = _sums.sum_by_additions(jnp.asarray(x), axes)
    np.testing.assert_allclose(got, x.sum(axes), rtol=1e-12, atol=1e-12)


def test_sum_by_additions_refuses_the_last_axis():
    with pytest.raises(ValueError, match="last axis"):
        _sums.sum_by_additions(jnp.ones((3, 4)), (1,))


@jax.jit
def _rows(x):
    return x.sum(axis=0)


def _fn(x, tree):
    a = _rows(x)  # (7, 9): additions, inside a nested jit
    b = x.sum(axis=(0, 1))  # (9,): additions
    c = x.sum(axis=-1)  # (6, 7): the last axis, a reduction
    d = tree["w"].sum(axis=0)  # (100, 3) over 100 rows: more than MAX_ADDED
    return {"a": a * 2.0, "b": jnp.sin(b), "c": c, "d": d + tree["v"]}


def test_sums_as_additions_gives_the_same_values_and_no_leading_reductions():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((6, 7, 9)))
    tree = {"w": jnp.asarray(rng.standard_normal((100, 3))), "v": jnp.ones(3)}
    wrapped = _sums.sums_as_additions(_fn)
    want, got = _fn(x, tree), wrapped(x, tree)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-12, atol=1e-12)
    before = _reductions_keeping_last(jax.make_jaxpr(_fn)(x, tree).jaxpr)
    after = _reductions_keeping_last(jax.make_jaxpr(wrapped)(x, tree).jaxpr)
    assert ((6, 7, 9), (0,)) in before and ((6, 7, 9), (0, 1)) in before
    assert after == [((100, 3), (0,))]  # only the one above MAX_ADDED is left


def test_sums_as_additions_composes_with_transformations():
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((5, 6, 4)))
    tree = {"w": jnp.asarray(rng.standard_normal((100, 3))), "v": jnp.ones(3)}

    def scalar(f):
        return lambda x: sum(jnp.sum(v**2) for v in jax.tree.leaves(f(x, tree)))

    wrapped = _sums.sums_as_additions(_fn)
    np.testing.assert_allclose(
        jax.grad(scalar(wrapped))(x), jax.grad(scalar(_fn))(x), rtol=1e-12
    )
    np.testing.assert_allclose(
        jax.jit(jax.hessian(scalar(wrapped)))(x[:2, :2, :2]),
        jax.hessian(scalar(_fn))(x[:2, :2, :2]),
        rtol=1e-10,
        atol=1e-12,
    )
    batched = jax.vmap(lambda x: wrapped(x, tree)["b"])(x[None].repeat(3, 0))
    np.testing.assert_allclose(batched[1], _fn(x, tree)["b"], rtol=1e-12)


def test_theta_pull_back_has_no_reduction_over_the_stages():
    """The parameters' pull-back of a step sums each per-patch rate's
    cotangent over the stages and rows by additions, and still equals the
    pull-back autodiff writes."""
    n = 7

    def f(t, y, th):
        rate, beta = th
        inf = beta * y[0] * y[2]
        return jnp.stack([-inf, inf - rate * y[1], rate * y[1] - 0.5 * y[2]])

    rng = np.random.default_rng(3)
    ts = jnp.linspace(0.0, 1.0, 6)
    Ys = jnp.asarray(rng.random((6, 3, n)))
    mus = jnp.asarray(rng.standard_normal((6, 3, n)))
    theta = (jnp.asarray(rng.random(n)), jnp.asarray(rng.random(n)))
    got = _erk._theta_vjp(f, ts, Ys, mus, theta)

    def plain(th):
        return sum(jnp.vdot(f(ts[i], Ys[i], th), mus[i]) for i in range(6))

    want = jax.grad(plain)(theta)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-14)
    jaxpr = jax.make_jaxpr(lambda th: _erk._theta_vjp(f, ts, Ys, mus, th))(theta)
    assert _reductions_keeping_last(jaxpr.jaxpr) == []


@pytest.mark.parametrize(
    "shape", [(), (5,), (16, 280), (2, 3, 4), (_sums.MAX_ADDED * 2 + 3, 5), (0, 4)]
)
def test_sum_of_squares_and_rms_norm(shape):
    x = np.random.default_rng(4).standard_normal(shape)
    np.testing.assert_allclose(sum_of_squares(jnp.asarray(x)), np.sum(x**2), rtol=1e-12)
    if x.size:
        tree = {"a": jnp.asarray(x), "b": jnp.ones(3)}
        want = np.sqrt((np.sum(x**2) + 3) / (x.size + 3))
        np.testing.assert_allclose(rms_norm(tree), want, rtol=1e-12)


@pytest.mark.parametrize("n", [_sums.MAX_ADDED * 3 + 1, _sums.MAX_ADDED * 4 + 2])
def test_sum_by_additions_halves_long_axes(n):
    """An axis longer than MAX_ADDED is halved first, odd slices kept aside."""
    x = np.random.default_rng(5).standard_normal((3, n, 4))
    got = _sums.sum_by_additions(jnp.asarray(x), (0, 1))
    np.testing.assert_allclose(got, x.sum((0, 1)), rtol=1e-12)
