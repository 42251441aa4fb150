"""The numbers of a fit's output, in one compiled program.

After the optimiser (and the Laplace approximation, whose own programs give
the covariance), everything a `FitResult` holds that JAX computes comes from
one program of `(x, se_x, z, data[, ys])`, built once per objective and
cached on it ([`output_program`][]): the solve at the fitted point (unless a
Gauss-Newton Laplace approximation's `jacobian_and_solution` already made it:
then its states `ys` are an argument), the fitted parameter pytree's arrays,
the constrained values, the time-varying parameters' daily values (for the
range check), the predictions, reproduction number and derived series of the
trajectory file (`epifit.simulation.trajectory_numbers`), the observations'
log-likelihood, and the parameter table's pieces (`table_numbers`). Its
outputs come back as NumPy at once ([`fit_numbers`][]); the host side only
formats them (NumPy, xarray), so no eager JAX operation (each its own small
program, compiled on first use and traced again in every process) runs on
the output path.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import equinox as eqx
import jax
import numpy as np

from epifit._stored import stored
from epifit.fitting._objective import Objective
from epifit.fitting._parameters import free_entries, problem_labels
from epifit.fitting._resolve import FitSetup
from epifit.fitting._uncertainty import _z, standard_errors, table_numbers
from epifit.simulation import Problem, trajectory_numbers

__all__ = [
    "check_solve",
    "coefficients",
    "fit_numbers",
    "gauss_newton_solve",
    "output_program",
]


def output_program(objective: Objective, *, solve: bool):
    """The compiled `(x, se_x, z, data) -> outputs` (`solve=True`: it solves
    at `x`) or `(x, se_x, z, data, ys) -> outputs` (the states of a solve
    already made at `x`), compiled once per objective. `outputs`: `params`
    (the parameter pytree's arrays, None at its other leaves), `values` (the
    constrained values, neural sub-models left out), `daily`, `trajectory`,
    `log_likelihood`, `table`, and with `solve` the `solution`'s `ys`,
    `stats` and `result` (the solve runs with `throw=False`)."""
    cache = objective.__dict__.setdefault("_output", {})
    if solve not in cache:
        # named so that a compile log reads `jit(fit_outputs)`
        if solve:

            def fit_outputs(x, se_x, z, data):
                return _outputs(objective, x, se_x, z, data, None)

        else:

            def fit_outputs(x, se_x, z, data, ys):
                return _outputs(objective, x, se_x, z, data, ys)

        # evaluated once a fit: compiled for that up to the reference size
        # (`Problem.compile_once`); kept across CLI runs with the same inputs
        # (`epifit._stored`)
        once = objective.problem.compile_once
        cache[solve] = stored(
            f"fit_outputs {solve}", fit_outputs, out_tree=None, once=once
        )
    return cache[solve]


def _outputs(objective: Objective, x, se_x, z, data, ys) -> dict:
    """The traced body of `output_program`."""
    problem, free = objective.problem, objective.free
    model = problem.model
    arrays = data["arrays"]
    params = objective.params(x, data)
    out = {}
    if ys is None:
        sol = problem.solve(params, objective.settings, arrays=arrays, throw=False)
        ys = sol.ys
        out["solution"] = {"ys": sol.ys, "stats": sol.stats, "result": sol.result}
    numbers = trajectory_numbers(problem, params, ys, arrays)
    out["trajectory"] = numbers
    # `Objective.log_likelihood_at`, from the predictions already made
    out["log_likelihood"] = objective._log_likelihood(
        params, numbers["predicted"], arrays, free.x0.dtype
    )
    neural = {n.name for n in problem.spec.neural}
    values = model.constrain(params)
    out["values"] = {k: v for k, v in values.items() if k not in neural}
    out["daily"] = model.daily_values(params)
    # the arrays only, as a list (`fit_numbers` puts them back in the
    # parameters' structure): the output is dicts and lists, which a stored
    # program can describe
    out["params"] = jax.tree.leaves(eqx.filter(params, eqx.is_array))
    out["table"] = table_numbers(objective, x, se_x, z, data["rest"])
    return out


def fit_numbers(objective: Objective, x, data, covariance, level: float, ys=None):
    """One call of `output_program` at the fitted free vector `x` (a device
    array), with the standard errors of `covariance` (None: NaN) for the
    table's intervals at `level`; `ys`: the states of a solve already made at
    `x` (NumPy), else the program solves. Returns a namespace of `params`
    (the fitted pytree, device arrays), `values` (NumPy, in the model's
    order), `daily`, `trajectory`, `table`, `log_likelihood` (float) and
    `solution` (`ys`, `stats`, `result` as NumPy; None when `ys` was given),
    all NumPy but `params`."""
    problem = objective.problem
    se_x = jax.device_put(standard_errors(objective.free, covariance))
    z = _z(level)
    if ys is None:
        out = output_program(objective, solve=True)(x, se_x, z, data)
    else:
        ys = jax.device_put(ys)
        out = output_program(objective, solve=False)(x, se_x, z, data, ys)
    arrays, static = eqx.partition(objective.free.template, eqx.is_array)
    fitted = jax.tree.unflatten(jax.tree.structure(arrays), out.pop("params"))
    params = eqx.combine(fitted, static)
    out = jax.tree.map(np.asarray, out)
    order = [p.name for p in problem.spec.parameters]
    order += list(problem.model.plan.derived_order)
    values = {k: out["values"][k] for k in order if k in out["values"]}
    values |= {k: v for k, v in out["values"].items() if k not in values}
    solution = out.get("solution")
    return SimpleNamespace(
        params=params,
        values=values,
        daily=out["daily"],
        trajectory=out["trajectory"],
        table=out["table"],
        log_likelihood=float(out["log_likelihood"]),
        solution=None if solution is None else SimpleNamespace(**solution),
    )


def gauss_newton_solve(setup: FitSetup, x_best, xs, data):
    """For a Gauss-Newton Laplace approximation, the solve at the best point
    (`ys`, `stats`, `result` as NumPy) and the residuals and their Jacobian
    there: one batched call of the executable the optimiser used. `(None,
    None)` otherwise: the output program solves (`fit_numbers`)."""
    if setup.uncertainty != "gauss_newton":
        return None, None
    # on the device (the optimiser's executable was called with device arrays)
    xb = jax.device_put(np.broadcast_to(np.asarray(x_best), xs.shape))
    compiled = setup.objective.compiled("jacobian_and_solution")
    r, J, ys, stats, result = compiled(xb, data)
    first = lambda a: np.asarray(a)[0]  # noqa: E731  NumPy: no eager slices
    sol = SimpleNamespace(
        ys=jax.tree.map(first, ys),
        stats=jax.tree.map(first, stats),
        result=first(result),
    )
    check_solve(sol)
    return sol, (first(r), first(J))


def check_solve(sol) -> None:
    """A failed solve at the fitted parameters is an error."""
    if int(sol.result) != 0:
        raise RuntimeError(
            "The solve at the fitted parameters failed (result code "
            f"{int(sol.result)}); try tighter solver tolerances or more max_steps."
        )


def coefficients(problem: Problem, fitted) -> dict[str, Any]:
    """Every array element of the fitted parameters (free or fixed), their
    labels and which are free: enough to rebuild `params` from a file."""
    arrays, _ = eqx.partition(fitted, eqx.is_inexact_array)
    labels, _ = problem_labels(problem, arrays)
    # `ravel_pytree`'s order and dtype, in NumPy (no eager concatenation)
    leaves = [np.asarray(a) for a in jax.tree.leaves(arrays)]
    flat = [np.ravel(a) for a in leaves]
    dtype = np.result_type(*leaves) if leaves else np.float64
    return dict(
        coefficients=np.concatenate(flat).astype(dtype, copy=False)
        if flat
        else np.zeros((0,), dtype),
        coefficient_labels=tuple(labels),
        coefficient_free=free_entries(fitted, problem.model.free_mask(fitted)),
    )
