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

from epifit.fitting._objective import make_objective
from epifit.ode import (
    BacksolveAdjoint,
    CheckpointAdjoint,
    ForwardAdjoint,
    InterpolatingAdjoint,
    QuadratureAdjoint,
)
from epifit.simulation import Problem


def default_adjoints() -> dict:
    return {
        "checkpoint": CheckpointAdjoint(),
        "backsolve": BacksolveAdjoint(),
        "interpolating": InterpolatingAdjoint(),
        "quadrature": QuadratureAdjoint(),
        "forward": ForwardAdjoint(),
    }


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


def _reference_gradient(problem: Problem, params, static, rtol: float, atol: float):
    """The checkpoint adjoint's gradient at `rtol, atol`, always in float64.

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
        loss = make_objective(problem64, rtol=rtol, atol=atol)

        def ref_loss(p, a):
            return loss(eqx.combine(p, static), a)

        params64 = jtu.tree_map(to64, params)
        arrays64 = jtu.tree_map(to64, problem.arrays)
        _, g = jax.jit(jax.value_and_grad(ref_loss))(params64, arrays64)
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
    adjoints: dict | None = None,
    rtol: float = 1e-6,
    atol: float = 1e-9,
    repeats: int = 3,
    max_forward_directions: int = 400,
) -> AdjointAudit:
    """Compute the loss gradient with every adjoint and compare them.

    The reference is the checkpoint adjoint (the exact derivative of the
    discrete solution) at tolerances 10^4 times tighter, computed in float64
    whatever the problem's dtype. For each adjoint the report gives its
    relative disagreement with the reference, the median evaluation time of
    `value_and_grad`, its lower + compile time and XLA's compile-time size of
    the executable's temporary and output buffers (not the process's RSS); it
    recommends the fastest adjoint whose error is within twice the checkpoint
    adjoint's (or 1e-3).

    Args:
        problem: a model bound to data (with observations).
        params: unconstrained parameters; default the model's initial values.
        adjoints: name -> adjoint; default all five.
        rtol, atol: the solver tolerances to audit at.
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
    params = problem.init_params() if params is None else params
    adjoints = default_adjoints() if adjoints is None else adjoints
    arrays = problem.arrays
    # neural sub-models carry non-array leaves (activations): differentiate the
    # inexact arrays only, with the rest closed over
    params, static = eqx.partition(params, eqx.is_inexact_array)
    n_params = ravel_pytree(params)[0].size

    def with_static(loss):
        return lambda p, a: loss(eqx.combine(p, static), a)

    ref_tree = _reference_gradient(problem, params, static, rtol * 1e-4, atol * 1e-4)
    g_ref = ravel_pytree(ref_tree)[0]
    if not np.all(np.isfinite(g_ref)):
        raise RuntimeError(
            "The reference gradient (checkpoint adjoint, float64, tolerances "
            f"rtol={rtol * 1e-4:g}, atol={atol * 1e-4:g}) is not finite at these "
            "parameters, so no adjoint can be compared with it; check the "
            "parameters and the loss (a solve that fails gives NaN)."
        )
    ref_norm = max(np.linalg.norm(g_ref), np.finfo(np.float64).tiny)

    records = []
    for name, adjoint in adjoints.items():
        rec = {"adjoint": name, "n_params": int(n_params)}
        if isinstance(adjoint, ForwardAdjoint) and n_params > max_forward_directions:
            rec["error"] = (
                f"skipped: {n_params} parameters (> {max_forward_directions}); "
                "forward sensitivities cost one solve per parameter"
            )
            records.append(rec)
            continue
        loss = with_static(
            make_objective(problem, adjoint=adjoint, rtol=rtol, atol=atol)
        )
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
            records.append(rec)
            continue
        g = np.asarray(ravel_pytree(g)[0], np.float64)
        rec.update(
            loss=float(value),
            eval_s=statistics.median(times),
            xla_temp_output_mb=_xla_temp_output_mb(compiled),
            rel_error=float(np.linalg.norm(g - g_ref) / ref_norm),
            finite=bool(np.all(np.isfinite(g))),
        )
        records.append(rec)

    recommended, reason = _recommend(records)
    return AdjointAudit(
        records,
        recommended,
        reason,
        f"checkpoint adjoint at rtol={rtol * 1e-4:g}, atol={atol * 1e-4:g}, float64",
        ref_tree,
    )
