"""Helpers shared by the adjoints."""

from __future__ import annotations

import jax.numpy as jnp
import jax.tree_util as jtu
from jax.custom_derivatives import SymbolicZero


def materialize(x):
    """A symbolic zero cotangent as an array of zeros."""
    if isinstance(x, SymbolicZero):
        return jnp.zeros(x.shape, x.dtype)
    return x


def split_perturbed(leaves, flags):
    """Indices of perturbed (differentiated) floating leaves."""
    return [
        i
        for i, (x, p) in enumerate(zip(leaves, flags, strict=True))
        if p and jnp.issubdtype(jnp.result_type(x), jnp.inexact)
    ]


def merge(leaves, idx, sub):
    out = list(leaves)
    for i, s in zip(idx, sub, strict=True):
        out[i] = s
    return out


def leaves_of(tree):
    return jtu.tree_flatten(tree)
