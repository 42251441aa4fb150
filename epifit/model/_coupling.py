"""Metapopulation coupling: the infectious mass seen through a matrix covariate."""

from __future__ import annotations

from jaxtyping import Array, Float

__all__ = ["coupled_mass"]


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
    ci = matrix @ i
    if symmetrize:
        ci = ci + i @ matrix
    if scale is not None:
        ci = scale * ci
    if multiplier != 1.0:
        ci = multiplier * ci
    return ci
