"""`epifit._flat.ravel`: `ravel_pytree`'s vector and inverse, in NumPy on
concrete leaves (no program compiled), in JAX on traced ones."""

import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

from epifit._flat import ravel


def _tree():
    return {
        "a": jnp.arange(6.0, dtype=jnp.float32).reshape(2, 3),
        "b": (jnp.float32(2.5), jnp.asarray([1, 2], jnp.int32)),
        "c": [],
    }


def _compiles():
    n = [0]

    def listen(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            n[0] += 1

    return n, listen


def test_ravel_is_ravel_pytree_in_numpy():
    tree = _tree()
    ref, ref_unravel = ravel_pytree(tree)
    n, listen = _compiles()
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        flat, unravel = ravel(tree)
        back = unravel(flat)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert n[0] == 0
    assert isinstance(flat, np.ndarray) and flat.dtype == ref.dtype
    np.testing.assert_array_equal(flat, np.asarray(ref))
    for u, v in zip(jax.tree.leaves(back), jax.tree.leaves(tree), strict=True):
        assert isinstance(u, np.ndarray)
        assert u.shape == v.shape and u.dtype == v.dtype
        np.testing.assert_array_equal(u, np.asarray(v))
    # a JAX vector gives JAX leaves, as ravel_pytree's inverse does
    for u, v in zip(
        jax.tree.leaves(unravel(jnp.asarray(flat))),
        jax.tree.leaves(ref_unravel(ref)),
        strict=True,
    ):
        assert isinstance(u, jax.Array) and u.dtype == v.dtype
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
    assert jax.tree.structure(back) == jax.tree.structure(tree)


def test_ravel_traced_and_differentiated():
    tree = {"w": jnp.ones((2, 2)), "b": jnp.zeros(3)}
    flat, unravel = ravel(tree)

    def f(x):
        t = unravel(x)
        again, _ = ravel(t)  # traced leaves: a JAX vector
        assert isinstance(again, jax.core.Tracer)
        return jnp.sum(again * x) + 2.0 * t["w"].sum()

    g = jax.jit(jax.grad(f))(jnp.asarray(flat))
    np.testing.assert_allclose(np.asarray(g), 2 * flat + np.r_[0, 0, 0, 2, 2, 2, 2])
    # the inverse pickles (an objective sent to worker processes holds one)
    copy = pickle.loads(pickle.dumps(unravel))
    np.testing.assert_array_equal(copy(flat)["w"], np.ones((2, 2)))


def test_unravel_checks_the_size():
    _, unravel = ravel(_tree())
    with pytest.raises(ValueError, match=r"shape \(9,\); got \(8,\)"):
        unravel(np.zeros(8))
