"""`Problem.solve` called outside a trace: one compiled program, kept.

Run eagerly, a solve's set-up (the initial state, the per-day rates) was one
small program per JAX operation, and its loops (`lax.scan`, `lax.while_loop`
over a fresh closure) compiled again at every call: on the 20-patch counts
model 44 compiles, 1.9 s, for the first call and 0.7-0.9 s for every later
one, in a notebook or a parameter sweep. Compiled whole and kept per problem,
the first call takes 1.1 s and each later one 2-3 ms, with the same states to
the bit (measured 2026-12-07).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax

from epifit._jit import jit, split_concrete
from epifit.ode import Result, Solution
from epifit.simulation._run import ModelRun

__all__ = ["solve_run"]

# Problem -> {what the program depends on: compiled solve}; an entry goes
# with its problem (the programs are never pickled with it).
_PROGRAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def solve_run(
    problem, run: ModelRun, params, arrays: Mapping[str, Any], throw: bool
) -> Solution:
    """`run(params, covariates, initial, throw=throw)`: traced in the
    caller's program when any input is a tracer (under `jit`, `grad`,
    `vmap`), else through one compiled program kept on `problem` per solve
    configuration and structure of the parameters.

    The program solves with `throw=False`; where the solve failed and `throw`
    is set, or a check of the inputs failed on the host (covariates changing
    off the break days), the solve runs again eagerly and raises its own
    error, as an eager solve did.
    """
    covariates, initial = arrays["covariates"], arrays["initial"]
    operands = (params, covariates, initial)
    split = split_concrete(operands, *_configuration(run))
    if split is None:  # under a trace, or not a key
        return run(params, covariates, initial, throw=throw)
    dynamic, static, key = split
    programs = _PROGRAMS.setdefault(problem, {})
    if key not in programs:
        programs[key] = _Program(run, static)
    program = programs[key]
    try:
        sol = jax.block_until_ready(program.run(dynamic))
    except jax.errors.JaxRuntimeError:
        # a host-side check raised inside the program, where its error is
        # wrapped: run eagerly, for the check's own error
        return run(params, covariates, initial, throw=throw)
    if throw and int(sol.result) != Result.SUCCESSFUL:
        return run(params, covariates, initial, throw=True)  # its SolverError
    # the statistics in the traced solve's order, its Python ints as such
    traced = program.traced_stats
    stats = {k: v if isinstance(v, int) else sol.stats[k] for k, v in traced.items()}
    return dataclasses.replace(sol, stats=stats)


def _configuration(run: ModelRun) -> tuple:
    """What a kept solve's program depends on besides the parameters'
    structure (`epifit._jit.split_concrete` adds it)."""
    return (
        id(run.model),  # the program holds the model: the id is not reused
        run.ts.tobytes(),
        run.n_patches,
        str(run.dtype),
        run.settings,
        run.broadcast_rates,
        run.breaks if run.breaks is None else tuple(run.breaks),
    )


class _Program:
    """A compiled solve (`run`, of the operands' array-like leaves), and the
    statistics of its solution as traced (`traced_stats`: the grid's counts
    are Python ints there)."""

    def __init__(self, run: ModelRun, static):
        def solved(dynamic):
            params, covariates, initial = eqx.combine(dynamic, static)
            sol = run(params, covariates, initial, throw=False)
            self.traced_stats = dict(sol.stats)
            return sol

        self.run = jit(solved)
        self.traced_stats: dict = {}
