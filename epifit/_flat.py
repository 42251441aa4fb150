"""`ravel`: a pytree's array leaves as one vector, without eager JAX programs.

`jax.flatten_util.ravel_pytree` concatenates the leaves with `jax.numpy`, so
on concrete leaves each call compiles small XLA programs (a reshape per
leaf shape, a concatenate: about 10 ms each, cold), and its inverse does the
same on a concrete vector. A fit's set-up (the free vector of the initial
parameters, a stored fit's coefficients) runs on concrete values, where
NumPy does the work with no compile; inside a traced function the same
calls use `jax.numpy`, as `ravel_pytree` does.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Unravel", "ravel"]


def _concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


@dataclasses.dataclass(frozen=True)
class Unravel:
    """The inverse of [`ravel`][]: a vector of the raveled size back into the
    tree, each leaf in its shape (and, where the leaves' dtypes differ, in
    its dtype; with one dtype the vector's passes through, as with
    `ravel_pytree`). A NumPy vector gives NumPy leaves (no program
    compiled); a JAX array or tracer gives JAX arrays, by the operations
    `ravel_pytree`'s inverse uses (so a compiled objective is the same
    program, bit for bit)."""

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]
    offsets: tuple[int, ...]

    def __call__(self, flat):
        size = self.offsets[-1]
        if np.shape(flat) != (size,):
            raise ValueError(
                f"unravel needs a vector of shape ({size},); got {np.shape(flat)}."
            )
        bounds = zip(self.offsets[:-1], self.offsets[1:], strict=True)
        if isinstance(flat, np.ndarray):
            parts = [flat[a:b] for a, b in bounds]
        else:  # as `ravel_pytree`'s inverse: the same program
            parts = jax.lax.split(flat, [b - a for a, b in bounds])
        leaves = [x.reshape(shape) for x, shape in zip(parts, self.shapes, strict=True)]
        if len(set(self.dtypes)) > 1:  # one dtype: any vector's dtype passes through
            leaves = [x.astype(d) for x, d in zip(leaves, self.dtypes, strict=True)]
        return jax.tree.unflatten(self.treedef, leaves)


def ravel(tree) -> tuple[Any, Unravel]:
    """`(flat, unravel)` as `jax.flatten_util.ravel_pytree(tree)` gives them
    (the leaves in tree order, raveled, at their common dtype), with `flat`
    a NumPy vector when every leaf is concrete (a JAX array when one is
    traced)."""
    leaves, treedef = jax.tree.flatten(tree)
    shapes = tuple(tuple(np.shape(x)) for x in leaves)
    dtypes = tuple(np.dtype(jnp.result_type(x)) for x in leaves)
    offsets = tuple(np.cumsum([0, *(int(np.prod(s)) for s in shapes)]).tolist())
    unravel = Unravel(treedef, shapes, dtypes, offsets)
    dtype = jnp.result_type(*leaves) if leaves else jnp.result_type(float)
    if all(_concrete(x) for x in leaves):
        parts = [np.ravel(np.asarray(x)).astype(dtype) for x in leaves]
        flat = np.concatenate(parts) if parts else np.zeros(0, dtype)
    else:
        flat = jnp.concatenate([jnp.ravel(x).astype(dtype) for x in leaves])
    return flat, unravel
