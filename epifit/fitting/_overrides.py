"""A fit configuration's parameter overrides applied to a model.

The `[parameters]` table of a fit configuration changes a model's parameters
for one fit (initial value, fixed or free, transform, bounds) without editing
the model file; `calibrate` applies it before fitting and `FitResult`'s reader
applies it again to rebuild the fitted model from a `FIT.nc`.
"""

from __future__ import annotations

import copy
import dataclasses

from epifit.fitting._config import FitConfig, FitConfigError, ParameterOverride
from epifit.model import (
    ModelSpec,
    bounds_error,
    compile_model,
    default_bounds,
    value_error,
)
from epifit.simulation import Problem

__all__ = ["apply_overrides", "override_spec"]


def apply_overrides(problem: Problem, config: FitConfig) -> Problem:
    """The problem with the fit configuration's parameter overrides applied to
    its model (value, fixed, transform, bounds); the same problem if none."""
    spec = override_spec(problem.spec, config, problem.n_patches)
    if spec is problem.spec:
        return problem
    out = copy.copy(problem)
    out.model = compile_model(spec)
    return out


def override_spec(spec: ModelSpec, config: FitConfig, n_patches: int) -> ModelSpec:
    """The model spec with a fit configuration's parameter overrides; `spec`
    itself when they change nothing."""
    params = {p.name: p for p in spec.parameters}
    neural = {n.name: n for n in spec.neural}
    new_params, new_neural = dict(params), dict(neural)
    for name, o in config.parameters.items():
        if name in neural:
            new_neural[name] = _override_neural(neural[name], o, config)
        else:
            new_params[name] = _override_parameter(params[name], o, config, n_patches)
    if new_params == params and new_neural == neural:
        return spec
    return dataclasses.replace(
        spec,
        parameters=tuple(new_params[p.name] for p in spec.parameters),
        neural=tuple(new_neural[n.name] for n in spec.neural),
    )


def _fail(config: FitConfig, name: str, field: str, reason: str) -> FitConfigError:
    return FitConfigError(
        reason, file=config.source, location=f"parameters.{name}.{field}"
    )


def _override_neural(neural, o: ParameterOverride, config: FitConfig):
    """A neural sub-model with its override: only `fixed` (and `l2` or a
    normal or flat `prior` on its weights, not part of the model) apply."""
    for field in ("value", "transform", "bounds"):
        if getattr(o, field) is not None:
            raise _fail(
                config,
                neural.name,
                field,
                f"'{neural.name}' is a neural sub-model; only 'fixed', 'prior' and "
                "'l2' apply to it",
            )
    if o.prior is not None and o.prior.family == "lognormal":
        raise _fail(
            config,
            neural.name,
            "prior",
            f"'{neural.name}' is a neural sub-model: its weights take a normal or "
            "flat prior, not lognormal",
        )
    if o.prior is not None and o.l2:
        raise _fail(
            config,
            neural.name,
            "l2",
            f"'{neural.name}' has both a prior and l2 (an l2 penalty is a normal "
            "prior on the weights); give one of them",
        )
    if o.fixed is not None and o.fixed != neural.fixed:
        return dataclasses.replace(neural, fixed=o.fixed)
    return neural


def _override_parameter(p, o: ParameterOverride, config: FitConfig, n_patches: int):
    """A parameter with its override (value, fixed, transform, bounds), the
    value checked against the transform's range."""
    name = p.name
    if isinstance(o.fixed, str):
        raise _fail(
            config,
            name,
            "fixed",
            f"'{name}' is a parameter, not a neural sub-model: fixed = "
            f"{o.fixed!r} applies to neural sub-models only; give true or false",
        )
    transform = p.transform if o.transform is None else o.transform
    if o.bounds is not None:
        lo, hi = o.bounds
    elif o.transform is not None and o.transform != p.transform:
        lo, hi = default_bounds(transform)
    else:
        lo, hi = p.bounds
    if (why := bounds_error(transform, lo, hi)) is not None:
        raise _fail(config, name, "bounds", why)
    value = p.value if o.value is None else o.value
    if isinstance(value, tuple) and not p.per_patch:
        raise _fail(
            config, name, "value", f"'{name}' is a scalar parameter; give one number"
        )
    if isinstance(value, tuple) and len(value) != n_patches:
        raise _fail(
            config,
            name,
            "value",
            f"has {len(value)} values but the problem has {n_patches} patches",
        )
    for v in value if isinstance(value, tuple) else (value,):
        if (why := value_error(transform, v, lo, hi)) is not None:
            field = "value" if o.value is not None else "transform"
            raise _fail(config, name, field, why + "; give a value inside the range")
    fixed = p.fixed if o.fixed is None else o.fixed
    new = dataclasses.replace(
        p, value=value, transform=transform, bounds=(lo, hi), fixed=fixed
    )
    return p if new == p else new
