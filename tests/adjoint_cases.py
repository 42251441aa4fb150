"""Adjoints, tolerances and reference computations shared by the adjoint tests
(`test_adjoints.py`: SIR and the checkpoint's discrete gradient;
`test_adjoints_models.py`: the box-car SEIRD and the reference model)."""

from __future__ import annotations

import jax
import numpy as np

from epifit.ode import (
    BacksolveAdjoint,
    CheckpointAdjoint,
    ForwardAdjoint,
    InterpolatingAdjoint,
    PIDController,
    QuadratureAdjoint,
)

ADJOINTS = {
    "checkpoint": CheckpointAdjoint(),
    "backsolve": BacksolveAdjoint(),
    "backsolve-fullnorm": BacksolveAdjoint(seminorm=False),
    "interpolating": InterpolatingAdjoint(),
    "quadrature": QuadratureAdjoint(),
    "forward": ForwardAdjoint(),
}
# The same five by the names `SolverSettings(adjoint=...)` takes.
ADJOINT_NAMES = ("checkpoint", "forward", "backsolve", "interpolating", "quadrature")
RTOL, ATOL = 1e-9, 1e-11
CTRL = PIDController(rtol=RTOL, atol=ATOL)
# The checkpoint and forward adjoints differentiate the discrete solution, which
# is within ~RTOL of the exact one; the continuous adjoints solve the adjoint ODE
# to the same tolerance, and the interpolating/quadrature ones add the error of a
# cubic Hermite interpolant of the forward state on each step. Against a finite
# difference of a loss solved at RTOL, all agree to ~1e3 * RTOL relative.
GRAD_RTOL = 1e-6


def rel_error(a, b):
    a = np.asarray(jax.flatten_util.ravel_pytree(a)[0])
    b = np.asarray(jax.flatten_util.ravel_pytree(b)[0])
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def finite_differences(f, x, eps=1e-6):
    """Central finite differences of a scalar function of a flat vector."""
    x = np.asarray(x, np.float64)
    g = np.zeros_like(x)
    for i in range(x.size):
        e = np.zeros_like(x)
        e[i] = eps * max(1.0, abs(x[i]))
        g[i] = (float(f(x + e)) - float(f(x - e))) / (2 * e[i])
    return g
