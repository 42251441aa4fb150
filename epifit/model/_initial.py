"""The initial state of a compiled model, from its `[initial]` table."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
from jaxtyping import ArrayLike

from epifit._custom_types import Y
from epifit._schema import PATCH, STAGE
from epifit._toml import join
from epifit.model._errors import ModelSpecError
from epifit.model._spec import ModelSpec

__all__ = ["initial_state_of"]


def initial_state_of(
    spec: ModelSpec,
    values: Mapping[str, Any],
    data: Mapping[str, ArrayLike] | None,
    n_patches: int,
) -> Y:
    """`y0` of [`CompiledModel.initial_state`][epifit.model.CompiledModel] from
    the constrained `values` (parameters and derived quantities)."""
    data = {} if data is None else data
    env = dict(values)
    for c in spec.covariates:
        if c.dims == (PATCH,) and c.name in data:
            env[c.name] = jnp.asarray(data[c.name])
    dtype = jnp.result_type(float)
    initial = {i.compartment: i for i in spec.initial}
    y0 = {}
    for comp in spec.compartments:
        shape = (comp.stages, n_patches)
        init = initial.get(comp.name)
        loc = f"initial.{comp.name}"
        if init is None:
            y0[comp.name] = jnp.zeros(shape, dtype)
            continue
        if init.expression is not None:
            missing = [n for n in init.expression.names if n not in env]
            if missing:
                raise ModelSpecError(
                    f"data lacks {join(missing)}; found: {join(data)}",
                    file=spec.path,
                    location=loc,
                )
            v = init.expression.evaluate(env)
            first = jnp.broadcast_to(v, (n_patches,)).astype(dtype)
        else:
            if init.data not in data:
                raise ModelSpecError(
                    f"no data variable {init.data!r}; found: {join(data)}",
                    file=spec.path,
                    location=loc,
                )
            a = jnp.asarray(data[init.data], dtype)
            if a.shape == shape:
                y0[comp.name] = a
                continue
            if a.shape != (n_patches,):
                raise ModelSpecError(
                    f"data variable {init.data!r} has shape {a.shape}; expected "
                    f"({PATCH},) = ({n_patches},) or ({STAGE}, {PATCH}) = {shape}",
                    file=spec.path,
                    location=loc,
                )
            first = a
        rest = jnp.zeros((comp.stages - 1, n_patches), dtype)
        y0[comp.name] = jnp.concatenate([first[None, :], rest], axis=0)
    return y0
