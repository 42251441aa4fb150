"""Perron roots (the spectral radius of a non-negative matrix, its dominant
eigenvalue) for the reproduction number (`_reproduction.py`): `eigvals` of a
dense matrix (on CPU), Noda's iteration on a dense matrix (linear solves,
every backend) and power iteration on a matrix-free operator. The
iterations return `uᵀKv / uᵀv` at the converged left and right vectors,
held fixed, so that its derivative is the eigenvalue's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array

# Noda's iteration: its most iterations (it converges quadratically: a
# handful)
NODA_MAX_ITER = 50
# power iteration: the largest change of the eigenvectors (scaled to a
# largest entry of 1) at which it stops, and the most iterations
POWER_RTOL = 1e-10
POWER_MAX_ITER = 2000


def radius_dense(apply, shape) -> Array:
    K = jax.jacfwd(apply)(jnp.zeros(shape))
    size = shape[0] * shape[1]
    return jnp.max(jnp.real(jnp.linalg.eigvals(K.reshape(size, size))))


def _rtol(dtype) -> float:
    """`POWER_RTOL`, or 16 ulps where the dtype cannot reach it (float32)."""
    return max(POWER_RTOL, 16 * float(jnp.finfo(dtype).eps))


def has_eig() -> bool:
    """Whether `eigvals` (JAX's general eigendecomposition) is used on the
    default backend: on CPU. JAX does not lower it on a TPU ("MLIR
    translation rule for primitive 'eig' not found for platform tpu", a TPU
    v5e, JAX 0.10.2: every fit's outputs failed there); elsewhere Noda's
    iteration (`root_noda`) takes its place, which needs only linear solves."""
    return jax.default_backend() == "cpu"


def radius_noda(apply, shape, dtype) -> Array:
    """The Perron root of the dense `K_r` (formed by `jacfwd`), by `root_noda`."""
    size = shape[0] * shape[1]
    K = jax.jacfwd(apply)(jnp.zeros(shape, dtype)).reshape(size, size)
    return root_noda(K, dtype)


def root_noda(K, dtype) -> Array:
    """The Perron root of a dense non-negative `K` by Noda's iteration: the
    shift `sigma = max(K v / v)` is an upper bound of the root
    (Collatz-Wielandt), so `(sigma I - K)⁻¹` keeps `v` positive and its
    dominant direction is the Perron vector; the shifts fall to the root
    quadratically. Then three solves for the left vector and the estimate
    `uᵀKv / uᵀv` (`u, v` held fixed, so its derivative is the
    eigenvalue's)."""
    size = K.shape[0]
    Ks = jax.lax.stop_gradient(K)
    tiny = jnp.finfo(dtype).tiny
    eye = jnp.eye(size, dtype=dtype)

    def shift(v):
        return jnp.max(Ks @ v / v) * (1 + 8 * jnp.finfo(dtype).eps) + tiny

    def step(carry):
        v, sigma, _, k = carry
        x = jnp.abs(jnp.linalg.solve(sigma * eye - Ks, v))
        v = jnp.maximum(x / jnp.max(x), tiny)
        return v, shift(v), sigma, k + 1

    def more(carry):
        _, sigma, old, k = carry
        return (k < NODA_MAX_ITER) & (old - sigma > _rtol(dtype) * sigma)

    ones = jnp.ones(size, dtype)
    v, sigma, *_ = jax.lax.while_loop(
        more, step, (ones, shift(ones), jnp.asarray(jnp.inf, dtype), 0)
    )
    lu = jax.scipy.linalg.lu_factor(sigma * eye - Ks)
    u = ones
    for _ in range(3):
        x = jnp.abs(jax.scipy.linalg.lu_solve(lu, u, trans=1))
        u = x / jnp.maximum(jnp.max(x), tiny)
    v, u = jax.lax.stop_gradient(v), jax.lax.stop_gradient(u)
    return _quotient(lambda w: K @ w, u, v)


def radius_power(apply, apply_sg, shape, dtype) -> Array:
    """The Perron root by power iteration on `K_r` and its transpose (the
    left vector makes the estimate `uᵀKv / uᵀv` accurate to second order and
    its derivative, with `u, v` held fixed, the eigenvalue's)."""
    ones = jnp.ones(shape, dtype)
    _, transpose = jax.vjp(apply_sg, ones)
    shift = 0.25 * jnp.mean(transpose(ones)[0])  # against periodic matrices

    def step(carry):
        v, u, _, k = carry
        kv, ku = apply_sg(v) + shift * v, transpose(u)[0] + shift * u
        v2 = kv / jnp.maximum(jnp.max(jnp.abs(kv)), jnp.finfo(dtype).tiny)
        u2 = ku / jnp.maximum(jnp.max(jnp.abs(ku)), jnp.finfo(dtype).tiny)
        change = jnp.maximum(jnp.max(jnp.abs(v2 - v)), jnp.max(jnp.abs(u2 - u)))
        return v2, u2, change, k + 1

    def more(carry):
        _, _, change, k = carry
        return (k < POWER_MAX_ITER) & (change > _rtol(dtype))

    inf = jnp.asarray(jnp.inf, dtype)
    v, u, *_ = jax.lax.while_loop(more, step, (ones, ones, inf, 0))
    v, u = jax.lax.stop_gradient(v), jax.lax.stop_gradient(u)
    return _quotient(apply, u, v)


def _quotient(apply, u, v) -> Array:
    """`uᵀ K v / uᵀ v`, 0 where `uᵀ v = 0` (no susceptibles: `K = 0`)."""
    den = jnp.sum(u * v)
    ok = den > 0
    return jnp.where(ok, jnp.sum(u * apply(v)) / jnp.where(ok, den, 1), 0)
