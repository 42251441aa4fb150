"""Checks of concrete values at construction, shared by the model and data layers."""

import jax
import numpy as np

__all__ = ["check_positive"]


def check_positive(cls: str, name: str, value) -> None:
    """Reject a concrete non-positive parameter at construction."""
    if isinstance(value, jax.core.Tracer):
        return
    array = np.asarray(value)
    if array.dtype.kind not in "iuf":
        raise TypeError(f"{cls}({name}=...) must be a real number; got {value!r}.")
    if not np.all(array > 0):
        raise ValueError(f"{cls}({name}=...) must be > 0; got {value!r}.")
