"""The one entry point of the ODE core."""

from __future__ import annotations

import collections
import inspect

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.flatten_util import ravel_pytree

from epifit._jit import jit, split_concrete

from ._adjoint.base import AbstractAdjoint
from ._adjoint.checkpoint import CheckpointAdjoint
from ._errors import Result, SolverError, format_failure, raise_at_run_time
from ._grid import make_grid
from ._inputs import PiecewiseConstant
from ._kept import traced_once
from ._loop import Integrator
from ._misc import state_dtype
from ._solution import Solution
from ._solver import (
    AbstractAdaptiveSolver,
    AbstractImplicitSolver,
    AbstractSolver,
    Tsit5,
)
from ._step_size import (
    AbstractAdaptiveStepSizeController,
    ConstantStepSize,
    PIDController,
)


def solve(
    vector_field,
    y0,
    args=None,
    *,
    ts,
    inputs: PiecewiseConstant | None = None,
    solver: AbstractSolver | None = None,
    stepsize_controller=None,
    adjoint: AbstractAdjoint | None = None,
    dt0: float | None = None,
    max_steps: int = 4096,
    throw: bool = True,
    interpolate_saves: bool = False,
) -> Solution:
    """Integrate `dy/dt = vector_field(t, y, args, u)` segment by segment.

    The integration runs from `ts[0]` to `ts[-1]` over *segments*: the intervals
    between consecutive points of the union of the save times `ts` and the break
    times of `inputs`. On each segment the inputs are constant (`u` is the slice
    of `inputs.values` that holds there); the solver restarts at each boundary, so
    no step crosses a jump of the inputs, and each saved state is an exact
    segment end, unless `interpolate_saves`.

    Args:
        vector_field: `f(t, y, args, u) -> dy/dt`, with `dy/dt` the same pytree
            as `y`; `u` is `None` when there are no inputs.
        y0: the initial state, any pytree of floating arrays.
        args: differentiable arguments (parameters, per-solve constants).
        ts: the save times, concrete and increasing (NumPy or a Python list);
            the first is the initial time.
        inputs: piecewise-constant inputs (covariates) whose break times become
            segment boundaries.
        solver: a solver; default [`epifit.ode.Tsit5`][].
        stepsize_controller: [`epifit.ode.PIDController`][] (default, `rtol=1e-3,
            atol=1e-6`) or [`epifit.ode.ConstantStepSize`][].
        adjoint: how to differentiate; default [`epifit.ode.CheckpointAdjoint`][].
        dt0: the first step of an adaptive solve (default: chosen
            automatically).
        max_steps: the most steps (accepted plus rejected) in one segment.
        throw: raise on failure. Outside `jit` a [`epifit.ode.SolverError`][]
            naming the segment, time and cause is raised; inside `jit` the same
            message is raised at run time. With `throw=False` failures are
            reported in `Solution.result` and the states after the failure are
            NaN. The same holds for the backward pass of a continuous adjoint
            (too many steps, a step too small, a non-finite adjoint state, a
            segment longer than its `buffer`): it raises a `SolverError`
            naming the adjoint, the segment and the cause, or, with
            `throw=False`, gives a NaN gradient. The reverse-mode gradient
            of a solve that failed with `throw=False` is NaN where the loss
            uses a failed state, and exact where it uses only the states
            before the failure; the failed segments are not pulled back, so
            it costs no more than the gradient of the successful part.
        interpolate_saves: save the states at the save times that are not
            input break times by the solver's dense output (Tsit5's fourth
            order, else cubic Hermite), as diffrax's `SaveAt(ts=...)`, instead
            of stepping to each: far fewer steps where the solution is smooth
            over several save intervals. A segment holds at most `INNER_SAVES`
            (7) of them. Needs an adaptive controller, a first-same-as-last
            explicit solver, and `CheckpointAdjoint` (`unroll_first`, no
            `keep_first`) or `ForwardAdjoint`: else a `ValueError`.

    Called outside a trace (no operand a tracer), the solve runs as one
    compiled program, kept for the next call with the same vector field (the
    same Python object), save times, method and operand structure: a
    parameter sweep compiles once. The `KEPT_PROGRAMS` most recent programs
    are kept. As under `jax.jit`, Python state the vector field reads (a
    global, a closed-over NumPy array changed in place) is taken as it was
    at the first call: pass what changes in `args`. Under `jit`, `grad` or
    `vmap` the solve is traced into the caller's program.

    Returns:
        A [`epifit.ode.Solution`][].

    Raises:
        ValueError, TypeError: on bad arguments, at trace time.
        SolverError: when the solve fails and `throw=True`.

    Examples:
        >>> import jax.numpy as jnp
        >>> from epifit.ode import solve, PIDController
        >>> sol = solve(lambda t, y, args, u: -args * y, jnp.array(1.0), 0.5,
        ...             ts=[0.0, 1.0, 2.0],
        ...             stepsize_controller=PIDController(rtol=1e-8, atol=1e-10))
        >>> round(float(sol.ys[-1]), 6) == round(float(jnp.exp(-1.0)), 6)
        True
    """
    _check_vector_field(vector_field)
    solver, stepsize_controller, adjoint, ts_np = _check_arguments(
        ts, inputs, solver, stepsize_controller, adjoint, max_steps
    )
    if interpolate_saves:
        _check_interpolation(solver, stepsize_controller, adjoint)
    method = (solver, stepsize_controller, adjoint, dt0, max_steps, interpolate_saves)
    operands = (y0, args, inputs)
    program, dynamic = _kept_program(vector_field, operands, ts_np, method)
    if program is None:  # under a trace, or operands that cannot be a key
        return _solve(vector_field, operands, ts_np, method, throw)
    return _kept_solution(program(dynamic), ts_np, inputs, method, throw)


def _kept_solution(sol, ts_np, inputs, method, throw: bool) -> Solution:
    """A kept program's solution as the traced solve gives it: its failure
    raised (`throw`), its statistics in order, the grid's counts as ints."""
    _, stepsize_controller, _, _, max_steps, interpolate_saves = method
    grid = _grid(ts_np, inputs, stepsize_controller, _inner(interpolate_saves))
    code, seg, t_fail = sol.result, sol.failed_segment, sol.failed_t
    if throw:
        _raise_if_failed(sol.ys, code, seg, t_fail, grid, max_steps)
    stats = {k: sol.stats[k] for k in _STEP_STATS} | _grid_stats(grid)
    return Solution(sol.ts, sol.ys, stats, code, seg, t_fail)


def _solve(vector_field, operands, ts_np, method, throw: bool) -> Solution:
    """The solve, traced: `solve` after its arguments' checks."""
    y0, args, inputs = operands
    solver, stepsize_controller, adjoint, dt0, max_steps, interpolate_saves = method
    dtype = state_dtype(y0)
    grid = _grid(ts_np, inputs, stepsize_controller, _inner(interpolate_saves))
    values = None if inputs is None else inputs.values
    integ, args, flat0, unravel = _integrator(
        vector_field, y0, args, solver, stepsize_controller, max_steps, throw
    )
    ys_all, stats, fail = adjoint.loop(integ, grid, flat0, args, values, dt0)
    save = jnp.asarray(grid.save_index)
    ys = jax.vmap(unravel)(ys_all[save])
    code, seg, t_fail = fail
    if throw:
        ys = _raise_if_failed(ys, code, seg, t_fail, grid, max_steps)
    stats = _solution_stats(stats, grid)
    return Solution(jnp.asarray(ts_np, dtype), ys, stats, code, seg, t_fail)


# Solves called outside a trace (a notebook, a parameter sweep) run as one
# compiled program, kept for the next call with the same vector field,
# save times, method and operand structure: run eagerly, a solve's set-up
# was one program per JAX operation and its loops, over fresh closures,
# compiled again at every call. Two-state SIR, 60 days (2026-12-07): 1.1 s
# and 27 compiles for the first call, 0.4 s for every later one; compiled,
# 0.8 s once, then well under a millisecond. The most recent programs are
# kept (a vector field made anew for every call would otherwise keep every
# program it compiled).
_KEPT: collections.OrderedDict = collections.OrderedDict()
KEPT_PROGRAMS = 32


def _kept_program(vector_field, operands, ts_np, method):
    """`(program, dynamic)`: the kept compiled solve for these arguments
    (`throw=False`) and the operands' array-like leaves to call it with, or
    `(None, None)` where an operand is traced or a non-array leaf (or the
    vector field, or the method) cannot be hashed."""
    split = split_concrete(operands, vector_field, ts_np.tobytes(), method)
    if split is None:
        return None, None
    dynamic, static, key = split
    program = _KEPT.pop(key, None)
    if program is None:

        def ode_solve(dynamic):
            return _solve(
                vector_field, eqx.combine(dynamic, static), ts_np, method, False
            )

        program = jit(ode_solve)
    _KEPT[key] = program
    while len(_KEPT) > KEPT_PROGRAMS:
        _KEPT.popitem(last=False)
    return program, dynamic


def _inner(interpolate_saves: bool) -> int:
    return INNER_SAVES if interpolate_saves else 0


# The most save times interpolated inside one segment (`interpolate_saves`):
# the next is a segment boundary, so a segment stays short for the
# checkpoint adjoint, which replays its steps.
INNER_SAVES = 7


def _grid(ts_np, inputs, controller, inner=0):
    """The segment grid of the save times and the inputs' break times (with
    the steps per segment of a `ConstantStepSize`; `inner` save times
    interpolated inside a segment at most)."""
    fixed_dt = controller.dt0 if isinstance(controller, ConstantStepSize) else None
    return make_grid(
        ts_np, None if inputs is None else np.asarray(inputs.times), fixed_dt, inner
    )


def _check_interpolation(solver, controller, adjoint):
    """`interpolate_saves=True`'s needs, each refused with a `ValueError`."""
    if not isinstance(controller, AbstractAdaptiveStepSizeController):
        raise ValueError(
            "interpolate_saves=True needs an adaptive step-size controller such "
            "as PIDController(); fixed steps already land on the save times."
        )
    if not getattr(solver, "has_dense_output", False):
        raise ValueError(
            f"interpolate_saves=True needs a solver with a dense output (Tsit5, "
            f"Bosh3, Dopri5); got {type(solver).__name__}()."
        )
    if not adjoint.differentiates_inner_saves:
        raise ValueError(
            "interpolate_saves=True is differentiated by CheckpointAdjoint() "
            "(unroll_first=True, keep_first=False) or ForwardAdjoint(); got "
            f"{adjoint!r}."
        )


_STEP_STATS = ("num_accepted_steps", "num_rejected_steps", "num_rhs_evals")


def _solution_stats(stats, grid):
    """`Solution.stats` from the summed `SegmentStats` of the scan."""
    steps = (stats.n_accepted, stats.n_rejected, stats.n_evals)
    return dict(zip(_STEP_STATS, steps, strict=True)) | _grid_stats(grid)


def _grid_stats(grid) -> dict[str, int]:
    return {
        "num_segments": grid.input_index.size,
        "num_input_changes": int(np.count_nonzero(np.diff(grid.input_index))),
    }


def _check_vector_field(vector_field) -> None:
    """A `TypeError` for a vector field that cannot be called as `(t, y, args,
    u)` (a diffrax vector field takes `(t, y, args)`), before it is traced."""
    name = getattr(vector_field, "__name__", type(vector_field).__name__)
    if not callable(vector_field):
        raise TypeError(
            f"vector_field must be a function f(t, y, args, u); got {name}."
        )
    try:
        signature = inspect.signature(vector_field)
    except (TypeError, ValueError):  # no signature to read (a builtin, say)
        return
    try:
        signature.bind(None, None, None, None)
    except TypeError:
        raise TypeError(
            f"vector_field must take (t, y, args, u), with u the inputs (None "
            f"without them); {name}{signature} cannot (a diffrax vector field "
            "takes (t, y, args): add the argument u)."
        ) from None


def _check_arguments(ts, inputs, solver, stepsize_controller, adjoint, max_steps):
    """`solve`'s arguments checked at trace time, with their defaults:
    `(solver, stepsize_controller, adjoint, ts as float64 NumPy)`."""
    solver, stepsize_controller, adjoint = _check_method(
        solver, stepsize_controller, adjoint
    )
    ts_np = _check_ts(ts)
    if inputs is not None and not isinstance(inputs, PiecewiseConstant):
        raise TypeError(
            f"inputs must be a PiecewiseConstant; got {type(inputs).__name__}."
        )
    if max_steps < 1:
        raise ValueError(f"max_steps must be >= 1; got {max_steps}.")
    return solver, stepsize_controller, adjoint, ts_np


def _check_method(solver, stepsize_controller, adjoint):
    """The solver, step-size controller and adjoint, defaulted and checked.
    An implicit solver's unset Newton tolerances are the `PIDController`'s."""
    solver = Tsit5() if solver is None else solver
    if stepsize_controller is None:
        stepsize_controller = PIDController()
    adjoint = CheckpointAdjoint() if adjoint is None else adjoint
    if not isinstance(solver, AbstractSolver):
        raise TypeError(
            f"solver must be an epifit.ode solver such as Tsit5(); got {solver!r}."
        )
    if not isinstance(adjoint, AbstractAdjoint):
        raise TypeError(
            "adjoint must be an epifit.ode adjoint such as CheckpointAdjoint(); "
            f"got {adjoint!r}."
        )
    _check_solver_controller(solver, stepsize_controller)
    if isinstance(solver, AbstractImplicitSolver) and isinstance(
        stepsize_controller, PIDController
    ):
        solver = solver.with_default_tolerances(
            stepsize_controller.rtol, stepsize_controller.atol
        )
    return solver, stepsize_controller, adjoint


def _check_solver_controller(solver, controller):
    if isinstance(controller, AbstractAdaptiveStepSizeController):
        if not isinstance(solver, AbstractAdaptiveSolver):
            raise ValueError(
                f"{type(controller).__name__} needs an adaptive solver such as "
                f"Tsit5(); "
                f"got {type(solver).__name__}(). Use "
                "stepsize_controller=ConstantStepSize(dt0) for fixed steps."
            )
    elif not isinstance(controller, ConstantStepSize):
        raise TypeError(
            "stepsize_controller must be a PIDController or a ConstantStepSize; got "
            f"{type(controller).__name__}."
        )


def _check_ts(ts) -> np.ndarray:
    """The save times as a float64 NumPy array: concrete, 1-D, at least two,
    strictly increasing."""
    if isinstance(ts, jax.core.Tracer):
        raise TypeError(
            "ts must be concrete (a NumPy array or list): the segment grid is built at "
            "trace time. Pass ts as a static value, not a traced argument."
        )
    ts_np = np.asarray(ts, dtype=np.float64)
    if ts_np.ndim != 1 or ts_np.size < 2:
        raise ValueError(
            f"ts must be a 1-D array of at least 2 times; got shape {ts_np.shape}."
        )
    if not np.all(np.diff(ts_np) > 0):
        raise ValueError("ts must be strictly increasing.")
    return ts_np


def _integrator(vector_field, y0, args, solver, controller, max_steps, throw):
    """The [`Integrator`][] of a solve, on the solver's state buffer
    (`_pack`): `(integrator, array leaves of args, y0 packed, unpack)`."""
    # Non-array leaves of args (the activation functions of an eqx.nn.MLP, say)
    # are not JAX values: the vector field gets them back by closure.
    args, args_static = eqx.partition(args, eqx.is_array_like)
    if jtu.tree_leaves(args_static):
        vector_field = _with_static_args(vector_field, args_static)
    flat0, unravel, pack = _pack(y0)
    vf_flat = traced_once(_flat_vector_field(vector_field, y0, unravel, pack))
    integ = Integrator(vf_flat, solver, controller, max_steps, throw=throw)
    return integ, args, flat0, unravel


def _with_static_args(vector_field, args_static):
    def vf(t, y, args, u):
        return vector_field(t, y, eqx.combine(args, args_static), u)

    return vf


def _pack(y0):
    """`(buffer, unpack, pack)`: the state as one array, the way back, and
    the packing of a list of leaves (the vector field's output).

    When every leaf is at least 1-D and all share the last axis (`n` patches,
    say), the buffer is 2-D, `(rows, n)`: each leaf's leading axes become
    rows. Otherwise it is 1-D, as `ravel_pytree` makes it. The 2-D form keeps
    XLA CPU's loops over `(row, column)`: a 1-D buffer turns each slice of a
    `(stages, patch)` leaf into index arithmetic (a division per element)
    that does not vectorise (measurements: `epifit/ode/README.md`).
    """
    leaves, struct = jtu.tree_flatten(y0)
    shapes = [jnp.shape(x) for x in leaves]
    dtypes = [jnp.result_type(x) for x in leaves]
    dtype = jnp.result_type(*leaves)
    lasts = {s[-1] if len(s) else None for s in shapes}
    if len(lasts) != 1 or None in lasts or 1 in lasts:
        flat, unravel = ravel_pytree(y0)

        def pack_flat(leaves):
            return jnp.concatenate([jnp.ravel(x).astype(dtype) for x in leaves])

        return flat, unravel, pack_flat
    (n,) = lasts
    rows = [int(np.prod(s[:-1], dtype=np.int64)) for s in shapes]

    def pack(leaves):
        parts = zip(leaves, rows, strict=True)
        return jnp.concatenate([jnp.reshape(x, (r, n)).astype(dtype) for x, r in parts])

    def unpack(buf):
        # lax.split, whose transpose is one concatenate (slices transpose to
        # a sum of zero-padded arrays)
        parts = jax.lax.split(buf, rows, axis=0)
        leaves = [
            jnp.reshape(x, s).astype(d)
            for x, s, d in zip(parts, shapes, dtypes, strict=True)
        ]
        return jtu.tree_unflatten(struct, leaves)

    return pack(leaves), unpack, pack


def _flat_vector_field(vector_field, y0, unravel, pack):
    """The vector field on the solver's state buffer (see [`_pack`][]).

    The state stays a pytree for the user (the vector field sees and returns
    pytrees, `ys` is a pytree), but the solver's arithmetic (stage
    combinations, error norms, step acceptance) runs on one contiguous buffer:
    one fused kernel per operation instead of one per leaf, so fewer kernels
    to compile and to launch (measurements: `epifit/ode/README.md`). Cost: one
    concatenation of the output leaves and one split of the state per
    evaluation.
    """
    struct = jtu.tree_structure(y0)
    shapes = [jnp.shape(x) for x in jtu.tree_leaves(y0)]

    def vf_flat(t, y, args, u):
        dy = vector_field(t, unravel(y), args, u)
        leaves, dstruct = jtu.tree_flatten(dy)
        if dstruct != struct or [jnp.shape(x) for x in leaves] != shapes:
            raise ValueError(
                "The vector field must return the same pytree as y0 (structure and "
                f"shapes); y0 is {struct} with shapes {shapes}, the vector field "
                f"returned {dstruct} with shapes {[jnp.shape(x) for x in leaves]}."
            )
        return pack(leaves)

    return vf_flat


def _message(code, seg, t_fail, grid, max_steps):
    seg = int(seg)
    return format_failure(
        int(code),
        seg,
        float(t_fail),
        float(grid.bounds[seg]),
        float(grid.bounds[seg + 1]),
        max_steps,
    )


def _raise_if_failed(ys, code, seg, t_fail, grid, max_steps):
    if not isinstance(code, jax.core.Tracer):
        if int(code) != Result.SUCCESSFUL:
            raise SolverError(_message(code, seg, t_fail, grid, max_steps))
        return ys

    def check(code, seg, t_fail):
        code, seg, t_fail = np.asarray(code), np.asarray(seg), np.asarray(t_fail)
        for c, k, t in zip(code.ravel(), seg.ravel(), t_fail.ravel(), strict=True):
            if int(c) != Result.SUCCESSFUL:
                raise SolverError(_message(c, k, t, grid, max_steps))

    failed = code != Result.SUCCESSFUL
    return raise_at_run_time(ys, failed, check, code, seg, t_fail)
