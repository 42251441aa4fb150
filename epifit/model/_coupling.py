"""Metapopulation coupling: the infectious mass seen through a matrix covariate."""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

__all__ = ["SparseCoupling", "coupled_mass", "sparse_coupling"]


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
    matrix: Float[Array, "patch patch_to"],
    scale: Float[Array, " patch"] | Float[Array, ""] | None,
    *,
    symmetrize: bool,
    multiplier: float,
) -> Float[Array, " patch"]:
    """`multiplier * scale * (C @ i)`, with `C + Cᵀ` in place of `C` if symmetrized.

    `C[p, q]` is the weight with which infectious in patch `q` add to the force of
    infection in patch `p`. The matrix is never rebuilt: a per-patch scale of the
    rows, `(scale[:, None] * C) @ i`, equals `scale * (C @ i)`, and
    `(C + Cᵀ) @ i` equals `C @ i + i @ C`, so one day costs one or two
    matrix-vector products and no new `(patch, patch)` array.
    """
    if isinstance(matrix, SparseCoupling):
        w, cols = matrix.values, matrix.columns
        ci = jnp.sum(w * i[cols], axis=-1)
        if symmetrize:
            ci = ci + jnp.zeros_like(i).at[cols].add(w * i[:, None])
    else:
        ci = matrix @ i
        if symmetrize:
            ci = ci + i @ matrix
    if scale is not None:
        ci = scale * ci
    if multiplier != 1.0:
        ci = multiplier * ci
    return ci
