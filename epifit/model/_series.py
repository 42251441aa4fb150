"""Derived quantities that vary in time (`[derived]` expressions reading
compartment totals or covariates), evaluated along a trajectory.

Cost: one elementwise evaluation per series over `(time, patch)`, outside any
solve.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from epifit._schema import TIME
from epifit.model._plan import dependency_order

__all__ = ["derived_series"]


def derived_series(
    model, ys: Mapping[str, Any], params, covariates: Mapping[str, Any] | None = None
) -> dict[str, Array]:
    """`{name: (time, patch)}` for every derived series of `model` (with
    strata, `patch` is the cell axis: per-patch and per-stratum values are
    laid onto the cells, as `cell_values` does).

    Args:
        model: a `CompiledModel`.
        ys: `{compartment: (time, stage, patch)}`, a trajectory.
        params: unconstrained parameters.
        covariates: day-major covariates by name (those the series read); a
            time-varying one shorter than the trajectory carries its last day.

    Raises:
        KeyError: a covariate a series reads is not in `covariates`.
    """
    spec = model.spec
    if not spec.series:
        return {}
    n_time = next(iter(ys.values())).shape[0]
    env: dict[str, Any] = {}
    for name, v in model.cell_values(params).items():  # with strata: on cells
        v = jnp.asarray(v) if not hasattr(v, "layers") else v
        env[name] = v[None, :] if getattr(v, "ndim", None) == 1 else v
    for c in model.compartments:
        env[c] = ys[c].sum(axis=1)  # (time, patch)
    dims = {c.name: c.dims for c in spec.covariates}
    needed = {n for d in spec.series for n in d.expression.names if n in dims}
    for name in sorted(needed):
        if covariates is None or name not in covariates:
            raise KeyError(
                f"derived series need the covariate {name!r}; pass covariates"
            )
        x = jnp.asarray(covariates[name])
        if TIME in dims[name]:
            x = x[np.minimum(np.arange(n_time), x.shape[0] - 1)]
            x = x[:, None] if x.ndim == 1 else x
        else:
            x = x[None, :]
        env[name] = x
    exprs = {d.name: d.expression for d in spec.series}
    order = dependency_order({d.name: d.expression.names for d in spec.series})
    out = {}
    for name in order:
        value = exprs[name].evaluate(env)
        env[name] = value
        out[name] = jnp.broadcast_to(
            value, (n_time, ys[model.compartments[0]].shape[-1])
        )
    return out
