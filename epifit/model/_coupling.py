"""Metapopulation coupling: the infectious mass seen through a matrix covariate.

A coupling matrix is dense, stored by rows (`SparseCoupling`), or, in a model
with `[strata]` whose coupling names both a matrix over patches and a contact
matrix over strata, the Kronecker product of the two (`KronCoupling`), applied
as two small contractions and never formed.
"""

from __future__ import annotations

import functools

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

__all__ = [
    "KronCoupling",
    "SparseCoupling",
    "coupled_mass",
    "coupling_matrix",
    "sparse_coupling",
]


class SparseCoupling(eqx.Module):
    """A coupling matrix covariate stored by rows (ELLPACK): row `p` has weights
    `values[..., p, k]` on columns `columns[p, k]`.

    Mobility and commuting matrices are sparse (each patch exchanges with a
    few neighbours): with `k` entries per row, the coupling product of every
    vector-field evaluation costs `O(patch·k)` instead of `O(patch²)`, and a
    time-varying covariate holds `time·patch·k` weights instead of
    `time·patch²` (worked sizes: `epifit/model/README.md`). The sparsity
    pattern is the union over days; padding entries have weight 0. `values`
    keeps the time axis of the dense covariate (if any) first.
    """

    values: Float[Array, "*time patch k"]
    columns: Int[Array, "patch k"]

    @property
    def shape(self) -> tuple[int, ...]:
        n = self.columns.shape[0]
        return (*self.values.shape[:-2], n, n)

    @property
    def ndim(self) -> int:
        return len(self.shape)


class KronCoupling(eqx.Module):
    """`kron(M, C)` on the cells (patch-major: cell `p * n_strata + s`), never
    formed: cell `(p, s)` meets cell `(q, t)` with weight `M[p, q] * C[s, t]`.

    `M` (one day's `(patch, patch_to)`, dense or `SparseCoupling`) is the
    mobility between patches, `C` (one day's `(stratum, stratum_to)`) the
    contacts between strata. A product with the infectious mass `i (cell,)`
    reshaped to `X (patch, stratum)` is `M @ X @ Cᵀ`: `O(patch·stratum²)` for
    `C` plus `O(patch²·stratum)` dense or `O(patch·k·stratum)` sparse for
    `M`, against `O((patch·stratum)²)` for the dense cell matrix (which is
    never held either: `M` and `C` are the only arrays).
    """

    patch: Float[Array, "patch patch_to"] | SparseCoupling
    strata: Float[Array, "stratum stratum_to"]


def coupling_matrix(get, c) -> Array | SparseCoupling | KronCoupling:
    """The matrix of coupling plan `c` on the day `get` reads (`get(key)`
    from `args` or the day's inputs): dense, sparse rows with their columns
    (`<matrix>.columns`) or, with `c.contacts`, `kron(M, C)`."""
    m = get(c.matrix)
    try:
        m = SparseCoupling(m, get(c.matrix + ".columns"))
    except KeyError:
        pass
    if c.contacts is None:
        return m
    return KronCoupling(m, get(c.contacts_key))


def _patch_product(m, x: Array, transpose: bool) -> Array:
    """`M @ x` (or `Mᵀ @ x`) for `x (patch, stratum)`."""
    if isinstance(m, SparseCoupling):
        w, cols = m.values, m.columns
        if transpose:
            return jnp.zeros_like(x).at[cols].add(w[..., None] * x[:, None, :])
        return jnp.sum(w[..., None] * x[cols], axis=-2)
    return m.T @ x if transpose else m @ x


def _kron_product(k: KronCoupling, i: Array, symmetrize: bool) -> Array:
    """`kron(M, C) @ i` (plus `kron(M, C)ᵀ @ i` if symmetrized)."""
    x = jnp.reshape(i, (-1, k.strata.shape[-1]))  # (patch, stratum)
    ci = _patch_product(k.patch, x @ k.strata.T, False)
    if symmetrize:
        ci = ci + _patch_product(k.patch, x @ k.strata, True)
    return jnp.reshape(ci, jnp.shape(i))


def sparse_coupling(dense, *, max_density: float = 0.25):
    """A `SparseCoupling` of a concrete dense coupling covariate when at most
    `max_density` of each row is non-zero (on any day); else the dense array.

    Args:
        dense: `(time, patch, patch_to)` or `(patch, patch_to)`, concrete.
        max_density: the largest fraction of non-zeros per row worth storing
            sparsely.
    """
    a = np.asarray(dense)
    n = a.shape[-1]
    if a.ndim not in (2, 3) or a.shape[-2] != n:
        raise ValueError(
            "sparse_coupling needs (time, patch, patch) or (patch, patch); got "
            f"{a.shape}"
        )
    pattern = a != 0 if a.ndim == 2 else np.any(a != 0, axis=0)
    k = max(1, int(pattern.sum(axis=1).max()))
    if k > max_density * n:
        return dense
    columns = np.zeros((n, k), dtype=np.int32)
    for p in range(n):
        nz = np.flatnonzero(pattern[p])
        columns[p, : nz.size] = nz
        columns[p, nz.size :] = p  # padding: weight 0 on the patch itself
    rows = np.arange(n)[:, None]
    values = a[..., rows, columns]
    pad = np.arange(k)[None, :] >= pattern.sum(axis=1)[:, None]
    values = np.where(pad, 0.0, values).astype(a.dtype)
    return SparseCoupling(jnp.asarray(values), jnp.asarray(columns))


def coupled_mass(
    i: Float[Array, " patch"],
    matrix: Float[Array, "patch patch_to"] | SparseCoupling | KronCoupling,
    scale: Float[Array, " patch"] | Float[Array, ""] | None,
    *,
    symmetrize: bool,
    multiplier: float,
    once=None,
) -> Float[Array, " patch"]:
    """`multiplier * scale * (C @ i)`, with `C + Cᵀ` in place of `C` if symmetrized.

    `C[p, q]` is the weight with which infectious in patch `q` add to the force of
    infection in patch `p`. The matrix is never rebuilt: a per-patch scale of the
    rows, `(scale[:, None] * C) @ i`, equals `scale * (C @ i)`, and
    `(C + Cᵀ) @ i` equals `C @ i + i @ C`, so one day costs one or two
    matrix-vector products and no new `(patch, patch)` array.
    A `KronCoupling` is applied as `M @ X @ Cᵀ` on the cells reshaped to
    `(patch, stratum)` (see there).

    `once(fn, *operands)`, if given, evaluates the product `C @ i` where it
    costs at least `ONCE_MIN_WORK` multiply-adds (the vector field passes
    `computed_once`: the product is then one buffer, and the value the
    checkpoint adjoint keeps); a smaller product is cheaper computed where
    it is read (measurements: `epifit/model/README.md`).
    """
    product = functools.partial(coupled_product, symmetrize=symmetrize)
    if once is None or product_work(matrix) < ONCE_MIN_WORK:
        ci = product(i, matrix)
    else:
        ci = once(product, i, matrix)
    if scale is not None:
        ci = scale * ci
    if multiplier != 1.0:
        ci = multiplier * ci
    return ci


# The smallest coupling product (multiply-adds) computed once into its own
# buffer by the vector field (see `coupled_mass`).
ONCE_MIN_WORK = 2048


def product_work(
    matrix: Float[Array, "patch patch_to"] | SparseCoupling | KronCoupling,
) -> int:
    """The multiply-adds of one product `C @ i` (static: from the shapes)."""
    if isinstance(matrix, KronCoupling):
        n_strata = matrix.strata.shape[-1]
        n_patch = product_work(matrix.patch)
        return n_patch * n_strata + n_strata * n_strata * matrix.patch.shape[-2]
    if isinstance(matrix, SparseCoupling):
        return int(np.prod(matrix.columns.shape))
    return int(np.prod(matrix.shape[-2:]))


def coupled_product(
    i: Float[Array, " patch"],
    matrix: Float[Array, "patch patch_to"] | SparseCoupling | KronCoupling,
    *,
    symmetrize: bool,
) -> Float[Array, " patch"]:
    """`C @ i`, or `(C + Cᵀ) @ i` if symmetrized (see [`coupled_mass`][])."""
    if isinstance(matrix, KronCoupling):
        return _kron_product(matrix, i, symmetrize)
    if isinstance(matrix, SparseCoupling):
        w, cols = matrix.values, matrix.columns
        ci = jnp.sum(w * i[cols], axis=-1)
        if symmetrize:
            ci = ci + jnp.zeros_like(i).at[cols].add(w * i[:, None])
        return ci
    ci = matrix @ i
    if symmetrize:
        ci = ci + i @ matrix
    return ci
