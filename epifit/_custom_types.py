"""jaxtyping aliases shared across epifit."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxtyping import Array, ArrayLike, Float, PyTree

__all__ = ["Args", "Params", "RealScalarLike", "VectorField", "Y"]

#: State: `{compartment: (stage, patch)}`, or any pytree of arrays for the ODE core.
Y = PyTree[Float[Array, "..."]]
#: Per-solve constants of a vector field (static rates, scales, matrices).
Args = PyTree[Any]
#: Parameters in unconstrained coordinates: `{name: array | eqx.Module}`.
Params = dict[str, Any]
RealScalarLike = float | int | Float[ArrayLike, ""]
#: `vector_field(t, y, args, u) -> dy`, with `u` one slice of the inputs (or None).
VectorField = Callable[[RealScalarLike, Y, Args, PyTree[Any] | None], Y]
