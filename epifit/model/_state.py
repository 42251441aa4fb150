"""Rates that read the state: slots evaluated inside the vector field.

A rate expression may name a compartment; the name then means the
compartment's total over its stages in the same patch, shape `(patch,)`
(vaccination by doses per day, `rate = "doses / S"`; a prevalence-dependent
transmission, `"beta * exp(-k * I / N)"`). Such a slot cannot be evaluated
before the solve: `precompute` puts the other names it reads into `args`
(static: parameters, derived quantities, `(patch,)` covariates) or into the
per-day inputs (time-varying covariates, neural sub-models) under
`"names.NAME"`, and the vector field evaluates the slot from `y` and those.

Division in these expressions is safe: `a / b` is 0 where `b` is exactly 0
(and its derivatives there are 0, not NaN), so `doses / S` at `S = 0` gives
the rate 0 and the flow `rate * S = 0` instead of `inf * 0 = NaN`. Elsewhere
the rate `doses / S` moves exactly `doses` per day out of `S`. Cost: one
evaluation of the expression tree per vector-field evaluation.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from jaxtyping import Array

from epifit.model._plan import Plan, Slot

__all__ = ["NAMES", "put_state_names", "state_value"]

NAMES = "names."  # the prefix of the names a state slot reads, in args/inputs
STATE_NAMES = NAMES  # exported: forecasts re-stack these per scenario interval


def put_state_names(
    plan: Plan,
    static_env: Mapping[str, Any],
    day_env: Mapping[str, Array],
    args: dict[str, Array],
    per_day: dict[str, Array],
) -> None:
    """Add to `args` (static) or `per_day` (one value per day) every name
    other than a compartment that the state slots of `plan` read."""
    for s in plan.state_slots:
        for name in sorted({n for e in s.expressions for n in e.names}):
            if name in s.state:
                continue
            if name in day_env:
                per_day[NAMES + name] = day_env[name]
            else:
                args[NAMES + name] = static_env[name]


def state_value(slot: Slot, y: Mapping[str, Array], get: Callable) -> Array:
    """The value of a state slot at the state `y`; `get(key)` reads `args` or
    the day's inputs."""
    env = {}
    for e in slot.expressions:
        for name in e.names:
            if name in slot.state:
                x = y[name]
                env[name] = x.sum(axis=0) if x.shape[0] > 1 else x[0]
            else:
                env[name] = get(NAMES + name)
    total = None
    for e in slot.expressions:
        v = e.evaluate(env, safe_division=True)
        total = v if total is None else total + v
    return total if slot.factor == 1.0 else slot.factor * total
