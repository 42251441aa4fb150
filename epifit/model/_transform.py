"""Parameter transforms between unconstrained and constrained coordinates."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike

__all__ = [
    "TRANSFORMS",
    "check_range",
    "constrain",
    "default_bounds",
    "unconstrain",
    "value_error",
]

TRANSFORMS = ("identity", "exp", "softplus", "sigmoid")


def default_bounds(transform: str) -> tuple[float, float]:
    """The range a transform maps onto when no `bounds` are given."""
    if transform == "identity":
        return (-math.inf, math.inf)
    if transform == "sigmoid":
        return (0.0, 1.0)
    return (0.0, math.inf)


def bounds_error(transform: str, lo: float, hi: float) -> str | None:
    """Why `bounds = [lo, hi]` does not suit `transform`, or `None`."""
    if math.isnan(lo) or math.isnan(hi) or not lo < hi:
        return f"bounds must satisfy lower < upper; got [{lo}, {hi}]"
    if transform in ("exp", "softplus"):
        if not math.isfinite(lo) or hi != math.inf:
            return (
                f"transform {transform!r} maps onto (lower, inf): give a finite lower "
                f"bound and inf as the upper one (got [{lo}, {hi}]); for a two-sided "
                'bound use transform = "sigmoid"'
            )
    if transform == "sigmoid" and not (math.isfinite(lo) and math.isfinite(hi)):
        return f"transform 'sigmoid' needs finite bounds; got [{lo}, {hi}]"
    return None


def value_error(transform: str, value: float, lo: float, hi: float) -> str | None:
    """Why an initial `value` cannot be represented, or `None`."""
    if not math.isfinite(value):
        return f"value {value} is not finite"
    if transform == "identity":
        if not lo <= value <= hi:
            return f"value {value} lies outside bounds [{lo}, {hi}]"
        return None
    if not lo < value < hi:
        return (
            f"value {value} must lie strictly inside ({lo}, {hi}), the range of "
            f"transform {transform!r}"
        )
    return None


def check_range(p, path: str | None, value: Any) -> None:
    """Raise a `ValueError` where a concrete `value` of parameter `p` (a
    `ParameterSpec`; traced values are not checked, NaN is left to the
    solve) lies outside its range, naming the parameter and the model file."""
    if isinstance(value, jax.core.Tracer):
        return
    lo, hi = p.bounds
    if (lo, hi) == (-math.inf, math.inf):
        lo, hi = default_bounds(p.transform)
    for v in np.ravel(np.asarray(value, dtype=np.float64)):
        if np.isnan(v):  # NaN is left to the solve, which reports it
            continue
        if why := value_error(p.transform, float(v), lo, hi):
            where = f" (model {path})" if path else ""
            raise ValueError(
                f"parameter {p.name!r} = {float(v):g} is out of its range: "
                f"{why}{where}; give a value inside the range"
            )


def constrain(transform: str, x: ArrayLike, lo: float, hi: float) -> Array:
    """Map unconstrained `x` to the constrained scale."""
    x = jnp.asarray(x)
    if transform == "identity":
        return x
    if transform == "exp":
        y = jnp.exp(x)
    elif transform == "softplus":
        y = jax.nn.softplus(x)
    else:
        return lo + (hi - lo) * jax.nn.sigmoid(x)
    return y if lo == 0.0 else lo + y


def unconstrain(
    transform: str, y: ArrayLike, lo: float, hi: float, *, xp: Any = jnp
) -> Array:
    """Inverse of [`constrain`][]; `xp=np` computes it in NumPy (set-up of
    concrete values, no compiled operations)."""
    y = xp.asarray(y)
    if transform == "identity":
        return y
    if transform == "sigmoid":
        z = (y - lo) / (hi - lo)
        return xp.log(z) - xp.log1p(-z)
    z = y if lo == 0.0 else y - lo
    if transform == "exp":
        return xp.log(z)
    return z + xp.log(-xp.expm1(-z))
