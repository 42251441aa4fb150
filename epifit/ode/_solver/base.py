"""Solver interfaces."""

from __future__ import annotations

import abc
from typing import ClassVar

import equinox as eqx


class AbstractSolver(eqx.Module):
    """A one-step method for `dy/dt = f(t, y, args, u)`.

    A solver is a fixed tableau; its stages are unrolled at trace time. The
    vector field `vf(t, y, args, u)` takes the time, the state pytree, the
    (differentiable) arguments and the inputs `u` that hold on the current
    segment.

    Solvers carry a small state between steps (for first-same-as-last methods, the
    vector field at the start of the next step). At every segment boundary the
    state is rebuilt with `init`, since the inputs may jump there.
    """

    order: eqx.AbstractClassVar[int]

    @abc.abstractmethod
    def init(self, vf, t0, y0, args, u):
        """The solver state at the start of a segment, and its vector-field evaluations.

        Returns:
            `(state, n_evals)`.
        """

    @abc.abstractmethod
    def step(self, vf, t0, t1, y0, args, u, state):
        """One step from `t0` to `t1`.

        Returns:
            `(y1, y_error, state_if_accepted, n_evals)`; `y_error` is `None` for
            solvers without an error estimate.
        """

    def fresh_step(self, vf, t0, t1, y0, args, u):
        """A step that evaluates everything it needs from `y0` (no carried state).

        This is the function the discrete adjoints differentiate.
        """
        state, _ = self.init(vf, t0, y0, args, u)
        y1, _, _, _ = self.step(vf, t0, t1, y0, args, u, state)
        return y1


class AbstractAdaptiveSolver(AbstractSolver):
    """Marks solvers whose step returns a local error estimate.

    `error_order` is the order used by step-size controllers
    (one plus the order of the lower-order embedded method).
    """

    error_order: eqx.AbstractClassVar[int]


class AbstractImplicitSolver(AbstractAdaptiveSolver):
    """Marks implicit (stiff) solvers: each stage solves a nonlinear system."""

    def with_default_tolerances(self, rtol: float, atol: float):
        """This solver with unset nonlinear-solve tolerances taken from the
        step-size controller (`solve` calls it with a `PIDController`'s)."""
        return self


__all__ = [
    "AbstractSolver",
    "AbstractAdaptiveSolver",
    "AbstractImplicitSolver",
    "ClassVar",
]
