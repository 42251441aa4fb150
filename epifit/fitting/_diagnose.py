"""Why the loss is not finite at a point: the solve, an observation, a
parameter or the prior, said in one line.

[`explain_nonfinite`][] takes the objective apart at one free vector: the
constrained parameter values, the solve (its `Result` code, segment and time),
the state, each observation's loss (and the first point where it overflows)
and the penalty. It runs eagerly, once, on the error path only.
"""

from __future__ import annotations

import jax
import numpy as np

from epifit._errors import LocatedError
from epifit.fitting._objective import Objective, observation_model
from epifit.ode import Result

__all__ = ["NonFiniteStartError", "explain_nonfinite"]


class NonFiniteStartError(LocatedError, FloatingPointError):
    """The loss or its gradient is not finite at every starting point.

    A `LocatedError`, so the CLI reports it as one `epifit: error:` line, and a
    `FloatingPointError`, as it was before it said why (the optimiser raises
    it; `calibrate` adds the cause from `explain_nonfinite`)."""


def _where(problem, k: int, j: int) -> str:
    day = f"day {k}"
    if problem.dates is not None and k < len(problem.dates):
        day += f" ({np.datetime_as_string(problem.dates[k], unit='D')})"
    patch = f", patch '{problem.patches[j]}'" if problem.n_patches > 1 else ""
    return day + patch


def _values(problem, values, reference) -> str:
    """`beta = 1e+06 (the model file's: 2), gamma = 0.5`: the parameters, those
    that differ from the model file's values first, with those values."""
    model = reference.model.constrain(reference.init_params())
    changed, same = [], []
    for p in problem.spec.parameters:
        v = np.asarray(values[p.name], np.float64)
        w = np.asarray(model[p.name], np.float64)
        text = f"{p.name} = {float(v):.6g}" if v.ndim == 0 else f"{p.name}[...]"
        if v.shape == w.shape and not np.allclose(v, w, rtol=1e-9, atol=0):
            text += f" (the model file's: {float(w):.6g})" if w.ndim == 0 else ""
            changed.append(text)
        else:
            same.append(text)
    return ", ".join(changed + same)


def explain_nonfinite(objective: Objective, x, data, reference=None) -> str:
    """Why the loss (or its gradient) at free vector `x` is not finite: the
    first cause found, naming the parameter, the solve's segment and time, or
    the observation and the point. Parameter values that differ from those of
    `reference` (the problem as the model file gives it, before a fit
    configuration's overrides; default the objective's) are named first."""
    problem = objective.problem
    params = objective.params(x, data)
    values = problem.model.constrain(params)
    for p in problem.spec.parameters:
        v = np.asarray(values[p.name], np.float64)
        if not np.all(np.isfinite(v)):
            return f"parameter '{p.name}' is not finite ({v.tolist()})"
    settings = objective.settings
    sol = problem.solve(params, settings, arrays=data["arrays"], throw=False)
    code = int(np.asarray(sol.result))
    at = _values(problem, values, reference or problem)
    if code != Result.SUCCESSFUL:
        seg, t = int(np.asarray(sol.failed_segment)), float(np.asarray(sol.failed_t))
        if code == Result.MAX_STEPS_REACHED:
            why = (
                f"the solver reached max_steps = {settings.max_steps} steps per "
                "segment; raise max_steps in the fit configuration (or loosen "
                "rtol/atol, or use a stiff solver such as kvaerno5)"
            )
        elif code == Result.NONFINITE_STATE:
            why = "the state became non-finite (NaN or inf)"
        else:
            why = "the step size fell below its minimum (a stiff problem?)"
        return f"the solve failed in segment {seg} at t = {t:.6g}: {why} (at {at})"
    for name, y in sol.ys.items():
        bad = ~np.isfinite(np.asarray(y, np.float64))
        if bad.any():
            k = int(np.argwhere(bad)[0][0])
            return (
                f"the state '{name}' is not finite from day {k} on (at {at}); "
                "check these parameter values"
            )
    pred = problem.predict(params, sol.ys, data["arrays"])
    arrays = data["arrays"]
    for o in objective.observations:
        p, y, m = pred[o.name], arrays["observed"][o.name], arrays["mask"][o.name]
        p, y, m = (np.asarray(a) for a in (p, y, m))
        days = problem.stamps[o.name].days
        if not np.all(np.isfinite(p[m])):
            k, j = (int(i) for i in np.argwhere(m & ~np.isfinite(p))[0])
            return (
                f"the prediction of observation '{o.name}' is not finite at "
                f"{_where(problem, int(days[k]), j)} (at {at})"
            )
        model = observation_model(o, values)
        total = float(model.loss(p, y, m))
        if np.isfinite(total):
            continue
        # the loss of every family is finite where its log-likelihood is
        points = np.asarray(model.point_log_likelihood(p, y, m))
        bad = np.argwhere(m & ~np.isfinite(points))
        if bad.size:
            k, j = (int(i) for i in bad[0])
            return (
                f"observation '{o.name}' gives a non-finite likelihood: "
                f"value {y[k, j]:.6g} against prediction {p[k, j]:.6g} at "
                f"{_where(problem, int(days[k]), j)} ({o.family}); check "
                "that value in the data"
            )
        return (
            f"observation '{o.name}' gives a non-finite likelihood ({o.family}, "
            f"loss {total}); check its values in the data"
        )
    penalty = float(objective.penalty(x, data))
    if not np.isfinite(penalty):
        return f"the priors and penalties give {penalty} (at {at})"
    _, g = jax.value_and_grad(objective.loss)(x, data)
    bad = [objective.free.labels[i] for i in np.flatnonzero(~np.isfinite(g))]
    if bad:
        return (
            f"the loss is finite but its gradient is not, with respect to "
            f"{', '.join(bad)} (at {at}); try another adjoint (--adjoint) or "
            "starting values"
        )
    return f"the loss and its gradient are finite here (at {at})"
