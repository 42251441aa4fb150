"""Piecewise-constant inputs of a vector field: covariates on a known grid."""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, PyTree


def _as_times(x) -> tuple[float, ...]:
    a = np.asarray(x, dtype=np.float64)
    if a.ndim != 1 or a.size == 0:
        raise ValueError(
            "PiecewiseConstant.times must be a non-empty 1-D array; got shape "
            f"{a.shape}."
        )
    return tuple(float(v) for v in a)


class PiecewiseConstant(eqx.Module):
    """Inputs that are constant between known times (a covariate grid).

    Value `k` (the `k`-th slice along the leading axis of every leaf of `values`)
    holds on `[times[k], times[k+1])`; the first value also holds before
    `times[0]` and the last one after `times[-1]`, as JAX's clamped gathers do.
    Every time in `times` that falls inside the integration interval becomes a
    segment boundary of [`epifit.ode.solve`][], so no solver step ever crosses a
    jump of the inputs.

    A daily covariate with the `floor` rule (day `k` holds on `[k, k+1)`) has
    `times = t0 + arange(n_days)`; with the `nearest` rule (day `k` holds on
    `[k-1/2, k+1/2)`) it has `times = t0 + arange(n_days) - 0.5`.

    `values` are data: their leaves are arrays with a leading axis of length
    `len(times)`. They are passed to the vector field one slice at a time, and a
    cotangent is formed for a leaf only when the caller differentiates with
    respect to it.

    Args:
        times: increasing, concrete break times, shape `(n,)` (stored as a tuple).
        values: pytree of arrays whose leading axis has length `n`.
    """

    times: tuple[float, ...] = eqx.field(static=True, converter=_as_times)
    values: PyTree[Array]

    def __check_init__(self):
        t = np.asarray(self.times)
        if t.size > 1 and not np.all(np.diff(t) > 0):
            raise ValueError("PiecewiseConstant.times must be strictly increasing.")
        n = t.size
        for path, leaf in jtu.tree_flatten_with_path(self.values)[0]:
            shape = jnp.shape(leaf)
            if len(shape) == 0 or shape[0] != n:
                raise ValueError(
                    f"PiecewiseConstant value {jtu.keystr(path)} has shape {shape}; "
                    f"its leading axis must have length len(times) = {n}."
                )

    def index(self, t: float) -> int:
        """The index of the value that holds at the (concrete) time `t`."""
        k = int(np.searchsorted(np.asarray(self.times), t, side="right")) - 1
        return min(max(k, 0), len(self.times) - 1)
