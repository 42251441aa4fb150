"""The adjoint audit: every adjoint's gradient, accuracy, speed and memory."""

from __future__ import annotations

import dataclasses
import statistics
import time

import equinox as eqx
import jax
import numpy as np
from jax.flatten_util import ravel_pytree

from epifit.fitting._objective import make_objective
from epifit.fitting._problem import Problem
from epifit.ode import (
    BacksolveAdjoint,
    CheckpointAdjoint,
    ForwardAdjoint,
    InterpolatingAdjoint,
    QuadratureAdjoint,
)


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
    """The audit's result: one record per adjoint and a recommendation."""

    records: list[dict]
    recommended: str
    reason: str
    reference: str

    def table(self) -> str:
        head = (
            f"{'adjoint':14s} {'rel. error':>10s} {'eval s':>9s} "
            f"{'compile s':>9s} {'temp MB':>8s}"
        )
        lines = [head, "-" * len(head)]
        for r in self.records:
            if "error" in r:
                lines.append(f"{r['adjoint']:14s} {r['error']}")
                continue
            mark = "  <- recommended" if r["adjoint"] == self.recommended else ""
            lines.append(
                f"{r['adjoint']:14s} {r['rel_error']:10.2e} {r['eval_s']:9.4f} "
                f"{r['compile_s']:9.2f} {r['temp_mb']:8.1f}{mark}"
            )
        lines.append(f"reference: {self.reference}")
        lines.append(f"recommended: {self.recommended} ({self.reason})")
        return "\n".join(lines)


def _temp_mb(compiled) -> float:
    try:
        m = compiled.memory_analysis()
        return float(m.temp_size_in_bytes + m.output_size_in_bytes) / 2**20
    except Exception:  # pragma: no cover - backend without memory analysis
        return float("nan")


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
    discrete solution) at tolerances 10^4 times tighter. For each adjoint the
    report gives its relative disagreement with the reference, the median
    evaluation time of `value_and_grad`, its lower + compile time and XLA's
    estimate of the executable's temporary and output memory; it recommends
    the fastest adjoint whose error is within twice the checkpoint adjoint's
    (or 1e-3).

    Args:
        problem: a model bound to data (with observations).
        params: unconstrained parameters; default the model's initial values.
        adjoints: name -> adjoint; default all five.
        rtol, atol: the solver tolerances to audit at.
        repeats: timed evaluations per adjoint.
        max_forward_directions: skip the forward adjoint above this many
            parameters (its cost grows with them).
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

    ref_loss = with_static(make_objective(problem, rtol=rtol * 1e-4, atol=atol * 1e-4))
    _, g_ref = jax.jit(jax.value_and_grad(ref_loss))(params, arrays)
    g_ref = np.asarray(ravel_pytree(g_ref)[0], np.float64)
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
            temp_mb=_temp_mb(compiled),
            rel_error=float(np.linalg.norm(g - g_ref) / ref_norm),
            finite=bool(np.all(np.isfinite(g))),
        )
        records.append(rec)

    ok = [r for r in records if "error" not in r and r["finite"]]
    if not ok:
        raise RuntimeError("No adjoint produced a finite gradient for this model.")
    base = next((r for r in ok if r["adjoint"] == "checkpoint"), None)
    limit = max(2 * base["rel_error"], 1e-3) if base else 1e-3
    good = [r for r in ok if r["rel_error"] <= limit] or ok
    best = min(good, key=lambda r: r["eval_s"])
    reason = (
        f"fastest gradient ({best['eval_s']:.4g} s) among those within "
        f"{limit:.1e} of the reference"
    )
    return AdjointAudit(
        records,
        best["adjoint"],
        reason,
        f"checkpoint adjoint at rtol={rtol * 1e-4:g}, atol={atol * 1e-4:g}",
    )
