"""`vmap_batch`: batching over starts or samples, unbatched for a batch of one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from epifit._vmap import default_group, vmap_batch


def fn(x, scale):
    """A cond on the state and a data-dependent loop, like a solve's."""
    y = jax.lax.cond(x.sum() > 0, lambda: x * scale, lambda: -x)

    def body(c):
        i, v = c
        return i + 1, v * 0.5

    n, y = jax.lax.while_loop(lambda c: jnp.max(jnp.abs(c[1])) > 1.0, body, (0, y))
    return {"y": y, "steps": n, "const": 7}


@pytest.mark.parametrize(
    "n, group", [(1, None), (3, None), (3, 1), (5, 2), (4, 2), (3, 7)]
)
def test_same_values_as_vmap(n, group):
    x = jnp.asarray(np.random.default_rng(0).normal(size=(n, 4)) * 5)
    got = vmap_batch(fn, in_axes=(0, None), group=group)(x, 3.0)
    want = jax.vmap(fn, in_axes=(0, None))(x, 3.0)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_array_equal(g, w)


def test_a_batch_of_one_keeps_its_conds():
    """Batched, the cond on a batched predicate becomes a select that runs both
    branches; for one start it stays a cond."""

    def prims(f, n):
        x = jnp.ones((n, 4))
        return {e.primitive.name for e in jax.make_jaxpr(f)(x, 2.0).jaxpr.eqns}

    assert "cond" not in prims(jax.vmap(fn, in_axes=(0, None)), 1)
    assert "cond" in prims(vmap_batch(fn, in_axes=(0, None)), 1)
    # two starts are batched as before
    assert "cond" not in prims(vmap_batch(fn, in_axes=(0, None)), 2)


def test_a_group_of_one_runs_members_unbatched_in_a_loop():
    def inner(f, n):
        x = jnp.ones((n, 4))
        (eqn,) = [e for e in jax.make_jaxpr(f)(x, 2.0).jaxpr.eqns if e.params]
        return eqn.primitive.name, {e.primitive.name for e in eqn.params["jaxpr"].eqns}

    name, body = inner(vmap_batch(fn, in_axes=(0, None), group=1), 3)
    assert name == "scan" and "cond" in body


def test_default_group_is_one_on_cpu_only():
    assert default_group("cpu") == 1
    assert default_group("gpu") is None


@pytest.mark.parametrize("group", [0, -1, True])
def test_group_must_be_positive(group):
    with pytest.raises(ValueError, match="group"):
        vmap_batch(fn, group=group)


def test_batch_sizes_must_agree():
    with pytest.raises(ValueError, match="batch size"):
        vmap_batch(fn)(jnp.ones((2, 4)), jnp.ones(3))
    with pytest.raises(ValueError, match="no argument has a batch axis"):
        vmap_batch(fn, in_axes=(None, None))(jnp.ones((2, 4)), 2.0)


def test_in_axes_must_match_the_arguments():
    with pytest.raises(TypeError, match="in_axes"):
        vmap_batch(fn, in_axes=(0,))(jnp.ones((1, 4)), 2.0)
