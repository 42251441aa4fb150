"""The fit objective in the optimiser's coordinates: `loss(x, data)`.

`x` is the flat vector of free parameters (see `FreeParameters`); `data` holds
the problem's arrays and the fixed parameter leaves, passed to compiled
functions as traced arguments. Solves run with `throw=False`: a failed solve
gives a non-finite loss, which the optimiser rejects and retreats from, instead
of an exception in the middle of a compiled loop.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from epifit._jit import jit
from epifit._vmap import default_group, vmap_batch
from epifit.fitting._objective import aligned, observation_model
from epifit.fitting._parameters import FreeParameters
from epifit.ode import jacobian
from epifit.simulation import Problem

__all__ = ["FitObjective"]


class FitObjective:
    """Loss, residuals and their derivatives for a problem and its free
    parameters.

    The loss is the sum of the observation losses (weighted least squares for
    gaussian observations, `weight` times the negative log-likelihood for
    poisson and negative binomial ones, missing points masked) plus the
    parameters' negative log-priors and L2 penalties.

    Attributes:
        least_squares: every observation is gaussian and every prior normal, so
            the loss is `sum(residuals(x) ** 2)`.
        n_data: the number of observed (unmasked) points the loss sums over.
        group: starting points batched together by the compiled methods
            (`vmap_batch`'s `group`; default `default_group()`: one at a time
            on CPU, all together elsewhere).
    """

    def __init__(
        self,
        problem: Problem,
        free: FreeParameters,
        *,
        solver=None,
        adjoint=None,
        rtol: float = 1e-6,
        atol: float = 1e-9,
        max_steps: int = 4096,
    ):
        self.problem = problem
        self.free = free
        self.observations = [
            o for o in problem.spec.observations if o.name in problem.observed
        ]
        if not self.observations:
            raise ValueError(
                f"Model '{problem.spec.name}' observes none of the dataset's "
                f"variables; it observes {[o.name for o in problem.spec.observations]}"
                ". Give a dataset with at least one of them."
            )
        self.solve_options = dict(
            solver=solver, adjoint=adjoint, rtol=rtol, atol=atol, max_steps=max_steps
        )
        # starts batched together by the compiled methods (see `default_group`)
        self.group = default_group()
        self.families = {o.name: o.family for o in self.observations}
        self.gaussian_data = all(f == "gaussian" for f in self.families.values())
        self.least_squares = self.gaussian_data and free.least_squares_penalty
        n = 0
        for o in self.observations:
            m = np.asarray(problem.mask[o.name]) & ~np.isnan(
                np.asarray(problem.observed[o.name])
            )
            if o.kind == "incidence" and m.shape[0] == problem.ts.size:
                m = m[1:]  # no prediction of the change before the first day
            n += int(m.sum())
        self.n_data = n

    # -- data -------------------------------------------------------------------
    def data(self) -> dict:
        """The traced data of every compiled call: arrays and fixed leaves."""
        return {"arrays": self.problem.arrays, "rest": self.free.rest}

    def params(self, x, data):
        return self.free.params(x, data["rest"])

    def predictions(self, x, data, *, throw: bool = False):
        params = self.params(x, data)
        sol = self.problem.solve(
            params, arrays=data["arrays"], throw=throw, **self.solve_options
        )
        return params, sol, self.problem.predict(params, sol.ys, data["arrays"])

    # -- loss ---------------------------------------------------------------------
    def data_loss(self, x, data):
        """The observation part of the loss."""
        params, _, pred = self.predictions(x, data)
        return self._data_loss(params, pred, data)

    def _data_loss(self, params, pred, data):
        values = self.problem.model.constrain(params)
        arrays = data["arrays"]
        total = jnp.zeros((), self.free.x0.dtype)
        for o in self.observations:
            p, y, m = aligned(
                pred[o.name], arrays["observed"][o.name], arrays["mask"][o.name]
            )
            term = observation_model(o, values).loss(p, y, m)
            if o.family != "gaussian":
                term = o.weight * term
            total = total + term
        return total

    def loss(self, x, data):
        """The total loss at free vector `x`."""
        params, _, pred = self.predictions(x, data)
        return self._data_loss(params, pred, data) + self.free.penalty(x, data["rest"])

    def value_and_grad(self, x, data):
        return jax.value_and_grad(self.loss)(x, data)

    # -- least squares --------------------------------------------------------------
    def _check_gaussian(self) -> None:
        if not self.gaussian_data:
            bad = {k: f for k, f in self.families.items() if f != "gaussian"}
            raise NotImplementedError(
                "Least-squares methods need gaussian observations; "
                + ", ".join(f"'{k}' is {f}" for k, f in bad.items())
                + ". Use the lbfgs or adam optimisers (and uncertainty method "
                "'hessian')."
            )

    def _data_residuals(self, pred, data):
        arrays = data["arrays"]
        parts = []
        for o in self.observations:
            p, y, m = aligned(
                pred[o.name], arrays["observed"][o.name], arrays["mask"][o.name]
            )
            m = m & jnp.isfinite(y)
            r = jnp.sqrt(jnp.asarray(o.weight, p.dtype)) * (p - jnp.where(m, y, p))
            parts.append(jnp.ravel(jnp.where(m, r, 0.0)))
        return jnp.concatenate(parts)

    @property
    def n_data_rows(self) -> int:
        """The length of the data residual vector (masked points included)."""
        n_t = self.problem.ts.size
        return sum(
            (n_t - 1 if o.kind == "incidence" else n_t) * self.problem.n_patches
            for o in self.observations
        )

    def data_residuals(self, x, data):
        """`sqrt(weight) * (predicted - observed)` at every point, 0 where masked."""
        self._check_gaussian()
        _, _, pred = self.predictions(x, data)
        return self._data_residuals(pred, data)

    def residuals(self, x, data):
        """All residuals: `loss(x) == sum(residuals(x) ** 2)` for least squares;
        the first `n_data_rows` are the data's, the rest the priors'/penalties'."""
        self._check_gaussian()
        _, _, pred = self.predictions(x, data)
        return jnp.concatenate(
            [
                self._data_residuals(pred, data),
                self.free.penalty_residuals(x, data["rest"]),
            ]
        )

    def jacobian_and_solution(self, x, data):
        """`(r, dr/dx, ys, stats, result)`: residuals, their Jacobian (forward
        sensitivities) and the solve they came from."""
        self._check_gaussian()

        def fn(x):
            _, sol, pred = self.predictions(x, data)
            r = jnp.concatenate(
                [
                    self._data_residuals(pred, data),
                    self.free.penalty_residuals(x, data["rest"]),
                ]
            )
            return r, (r, sol.ys, sol.stats, sol.result)

        J, (r, ys, stats, result) = jacobian(fn, has_aux=True)(x)
        return r, J, ys, stats, result

    def residuals_and_jacobian(self, x, data):
        """`(r, dr/dx)` with forward-mode sensitivities of the solve."""
        r, J, *_ = self.jacobian_and_solution(x, data)
        return r, J

    def solution(self, x, data):
        """`(ys, stats, result)` of the solve at `x` (no derivatives)."""
        _, sol, _ = self.predictions(x, data)
        return sol.ys, sol.stats, sol.result

    # -- compiled, batched over starts ---------------------------------------------
    def compiled(self, name: str):
        """`jit(vmap(method))` over a batch of `x` (see [`vmap_batch`][]),
        compiled once per objective."""
        cache = self.__dict__.setdefault("_compiled", {})
        if name not in cache:
            cache[name] = jit(
                vmap_batch(getattr(self, name), in_axes=(0, None), group=self.group)
            )
        return cache[name]
