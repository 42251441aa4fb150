"""The adjoint audit: every adjoint's gradient, accuracy, speed and memory."""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.flatten_util import ravel_pytree

from epifit.fitting._objective import Objective
from epifit.fitting._parameters import FreeParameters
from epifit.ode import AbstractAdjoint, ForwardAdjoint
from epifit.simulation import ADJOINTS, Problem, SolverSettings

__all__ = ["AdjointAudit", "audit_adjoints"]


@dataclasses.dataclass
class AdjointAudit:
    """The audit's result: one record per adjoint and a recommendation.

    Attributes:
        records: one dict per adjoint, in the order audited (see
            `audit_adjoints`); JSON-serializable.
        recommended: the recommended adjoint's name.
        reason: why, in words.
        reference: how the reference gradient was computed, in words.
        gradient: the reference gradient, float64 NumPy arrays in the structure
            of the differentiated (inexact array) parameters.
    """

    records: list[dict]
    recommended: str
    reason: str
    reference: str
    gradient: Any = None

    def table(self) -> str:
        head = (
            f"{'adjoint':14s} {'rel. error':>10s} {'eval s':>9s} "
            f"{'compile s':>9s} {'XLA temp+out MB':>15s}"
        )
        lines = [head, "-" * len(head)]
        for r in self.records:
            if "error" in r:
                lines.append(f"{r['adjoint']:14s} {r['error']}")
                continue
            mark = "  <- recommended" if r["adjoint"] == self.recommended else ""
            lines.append(
                f"{r['adjoint']:14s} {r['rel_error']:10.2e} {r['eval_s']:9.4f} "
                f"{r['compile_s']:9.2f} {r['xla_temp_output_mb']:15.1f}{mark}"
            )
        lines.append(f"reference: {self.reference}")
        lines.append(f"recommended: {self.recommended} ({self.reason})")
        return "\n".join(lines)


def _xla_temp_output_mb(compiled) -> float:
    """XLA's compile-time size of the executable's temporary and output buffers,
    in MB (2^20 bytes): not the process's resident memory (RSS), and without
    the arguments (parameters, data) or the code."""
    try:
        m = compiled.memory_analysis()
        return float(m.temp_size_in_bytes + m.output_size_in_bytes) / 2**20
    except Exception:  # pragma: no cover - backend without memory analysis
        return float("nan")


def _loss_of_arrays(problem: Problem, params, static, settings: SolverSettings):
    """`loss(p, arrays)`: the objective's observation loss at the inexact
    array leaves `p`, the other leaves (`static`) closed over."""
    objective = Objective(
        problem, FreeParameters(problem, eqx.combine(params, static)), settings
    )
    return lambda p, a: objective.params_loss(eqx.combine(p, static), a)


def _reference_gradient(problem: Problem, params, static, settings: SolverSettings):
    """The checkpoint adjoint's gradient at `settings`, always in float64.

    A float32 problem is copied with its parameters and data cast to float64
    (the data as the float32 problem holds them, so the reference solves the
    same problem) and differentiated under `jax.enable_x64(True)`, which leaves
    the session's precision alone. Constants that a model built in float32 keeps
    as float32 arrays keep their rounding (as the data do).
    """

    def to64(x):
        return jnp.asarray(x, jnp.float64) if eqx.is_inexact_array(x) else x

    with jax.enable_x64(True):
        problem64 = copy.copy(problem)
        problem64.dtype = jnp.dtype(jnp.float64)
        params64 = jtu.tree_map(to64, params)
        arrays64 = jtu.tree_map(to64, problem.arrays)
        loss = _loss_of_arrays(problem64, params64, static, settings)
        _, g = jax.jit(jax.value_and_grad(loss))(params64, arrays64)
        return jtu.tree_map(lambda x: np.asarray(x, np.float64), g)


def _recommend(records: list[dict]) -> tuple[str, str]:
    """The recommendation rule: among the adjoints that ran and gave a finite
    gradient, the fastest (`eval_s`) whose `rel_error` is at most
    `max(2 * checkpoint's rel_error, 1e-3)` (just 1e-3 without a checkpoint
    record); if none is, the fastest of them, said so in the reason."""
    ok = [r for r in records if "error" not in r and r["finite"]]
    if not ok:
        raise RuntimeError("No adjoint produced a finite gradient for this model.")
    base = next((r for r in ok if r["adjoint"] == "checkpoint"), None)
    limit = max(2 * base["rel_error"], 1e-3) if base else 1e-3
    good = [r for r in ok if r["rel_error"] <= limit]
    best = min(good or ok, key=lambda r: r["eval_s"])
    if good:
        reason = (
            f"fastest gradient ({best['eval_s']:.4g} s) among those within "
            f"{limit:.1e} of the reference"
        )
    else:
        reason = (
            f"fastest finite gradient ({best['eval_s']:.4g} s); none is within "
            f"{limit:.1e} of the reference"
        )
    return best["adjoint"], reason


def audit_adjoints(
    problem: Problem,
    params=None,
    *,
    adjoints: dict[str, AbstractAdjoint] | None = None,
    settings: SolverSettings | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    repeats: int = 3,
    max_forward_directions: int = 400,
) -> AdjointAudit:
    """Compute the loss gradient with every adjoint and compare them.

    The loss is the fit objective's observation loss (`Objective.params_loss`),
    differentiated with respect to every inexact array leaf of `params`, fixed
    ones included. The reference is the checkpoint adjoint (the exact
    derivative of the discrete solution) at tolerances 10^4 times tighter,
    computed in float64 whatever the problem's dtype. For each adjoint the
    report gives its relative disagreement with the reference, the median
    evaluation time of `value_and_grad`, its lower + compile time and XLA's
    compile-time size of the executable's temporary and output buffers (not
    the process's RSS); it recommends the fastest adjoint whose error is within
    twice the checkpoint adjoint's (or 1e-3).

    Cost: per adjoint one compile and `1 + repeats` evaluations of
    `value_and_grad`; the reference one more compile and evaluation.

    Args:
        problem: a model bound to data (with observations).
        params: unconstrained parameters; default the model's initial values.
        adjoints: name -> adjoint; default one of each in `ADJOINTS`.
        settings: the solver settings audited (default `SolverSettings()`);
            each audited adjoint replaces its adjoint.
        rtol, atol: solver tolerances replacing those of `settings`.
        repeats: timed evaluations per adjoint.
        max_forward_directions: skip the forward adjoint above this many
            parameters (its cost grows with them).

    Returns:
        An `AdjointAudit`. Each record has `adjoint` and `n_params`, and either
        `error` (why the adjoint was skipped or failed) or `loss`,
        `compile_s` (lower + compile of `value_and_grad`), `eval_s` (median
        evaluation), `xla_temp_output_mb`, `rel_error` (`|g - g_ref| /
        |g_ref|`, 2-norms over all parameters) and `finite`.

    Raises:
        RuntimeError: if the reference gradient is not finite, or no
            adjoint's gradient is.
    """
    settings = SolverSettings.of(settings, rtol=rtol, atol=atol)
    params = problem.init_params() if params is None else params
    if adjoints is None:
        adjoints = {name: cls() for name, cls in ADJOINTS.items()}
    # neural sub-models carry non-array leaves (activations): differentiate the
    # inexact arrays only, with the rest closed over
    params, static = eqx.partition(params, eqx.is_inexact_array)
    reference = dataclasses.replace(
        settings, rtol=settings.rtol * 1e-4, atol=settings.atol * 1e-4, adjoint=None
    )
    ref_tree = _reference_gradient(problem, params, static, reference)
    g_ref = _checked_reference(ref_tree, reference)
    records = [
        _audit_one(
            name,
            adjoint,
            problem,
            params,
            static,
            settings,
            g_ref,
            repeats,
            max_forward_directions,
        )
        for name, adjoint in adjoints.items()
    ]
    recommended, reason = _recommend(records)
    return AdjointAudit(
        records,
        recommended,
        reason,
        f"checkpoint adjoint at rtol={reference.rtol:g}, atol={reference.atol:g}, "
        "float64",
        ref_tree,
    )


def _checked_reference(ref_tree, reference: SolverSettings) -> np.ndarray:
    """The flat reference gradient; raises if it is not finite."""
    g_ref = ravel_pytree(ref_tree)[0]
    if not np.all(np.isfinite(g_ref)):
        raise RuntimeError(
            "The reference gradient (checkpoint adjoint, float64, tolerances "
            f"rtol={reference.rtol:g}, atol={reference.atol:g}) is not finite at "
            "these parameters, so no adjoint can be compared with it; check the "
            "parameters and the loss (a solve that fails gives NaN)."
        )
    return g_ref


def _audit_one(
    name, adjoint, problem, params, static, settings, g_ref, repeats, max_forward
) -> dict:
    """One adjoint's record: its error against `g_ref`, timings and memory, or
    why it was skipped or failed."""
    n_params = int(g_ref.size)
    rec = {"adjoint": name, "n_params": n_params}
    if isinstance(adjoint, ForwardAdjoint) and n_params > max_forward:
        rec["error"] = (
            f"skipped: {n_params} parameters (> {max_forward}); "
            "forward sensitivities cost one solve per parameter"
        )
        return rec
    settings = dataclasses.replace(settings, adjoint=adjoint)
    loss = _loss_of_arrays(problem, params, static, settings)
    arrays = problem.arrays
    try:
        t = time.perf_counter()
        compiled = jax.jit(jax.value_and_grad(loss)).lower(params, arrays).compile()
        rec["compile_s"] = time.perf_counter() - t
        value, g = jax.block_until_ready(compiled(params, arrays))
        times = []
        for _ in range(max(1, repeats)):
            t = time.perf_counter()
            jax.block_until_ready(compiled(params, arrays))
            times.append(time.perf_counter() - t)
    except Exception as e:  # an adjoint that fails on this model is reported
        rec["error"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        return rec
    g = np.asarray(ravel_pytree(g)[0], np.float64)
    ref_norm = max(np.linalg.norm(g_ref), np.finfo(np.float64).tiny)
    rec.update(
        loss=float(value),
        eval_s=statistics.median(times),
        xla_temp_output_mb=_xla_temp_output_mb(compiled),
        rel_error=float(np.linalg.norm(g - g_ref) / ref_norm),
        finite=bool(np.all(np.isfinite(g))),
    )
    return rec
