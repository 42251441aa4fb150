"""The calibration objective: observation likelihoods of a solved model."""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp

from epifit.data import Gaussian, NegativeBinomial, Poisson
from epifit.model import ObservationSpec
from epifit.simulation import Problem


def observation_model(obs: ObservationSpec, values):
    """The likelihood family of one observation, from its spec."""
    if obs.family == "gaussian":
        return Gaussian(weight=obs.weight)
    if obs.family == "poisson":
        return Poisson()
    if obs.family == "negative_binomial":
        if obs.dispersion is None:
            raise ValueError(
                f"observation '{obs.name}': family negative_binomial needs a "
                "dispersion parameter (dispersion = 'name')."
            )
        return NegativeBinomial(values[obs.dispersion])
    raise ValueError(f"observation '{obs.name}': unknown family '{obs.family}'.")


def aligned(pred, observed, mask):
    """Incidence predictions have one row less (no change before day 0)."""
    if pred.shape[0] == observed.shape[0] - 1:
        return pred, observed[1:], mask[1:]
    return pred, observed, mask


def make_objective(
    problem: Problem,
    *,
    solver=None,
    stepsize_controller=None,
    adjoint=None,
    rtol: float = 1e-6,
    atol: float = 1e-9,
    max_steps: int = 4096,
) -> Callable:
    """`loss(params, arrays) -> scalar`: the summed observation losses.

    Gaussian observations contribute their weighted least squares
    `weight * sum((predicted - observed)^2)`; Poisson and negative binomial ones
    `weight` times their negative log-likelihood. Missing points (NaN in the data)
    are masked out of value and gradient. `arrays` is `problem.arrays`, passed
    as a traced argument.
    """
    observed_specs = [
        o for o in problem.spec.observations if o.name in problem.observed
    ]
    if not observed_specs:
        raise ValueError(
            f"Model '{problem.spec.name}' observes none of the dataset's variables; "
            f"it observes {[o.name for o in problem.spec.observations]}."
        )

    def loss(params, arrays):
        sol = problem.solve(
            params,
            arrays=arrays,
            solver=solver,
            stepsize_controller=stepsize_controller,
            adjoint=adjoint,
            rtol=rtol,
            atol=atol,
            max_steps=max_steps,
        )
        pred = problem.predict(params, sol.ys, arrays)
        values = problem.model.constrain(params)
        total = jnp.zeros((), problem.dtype)
        for o in observed_specs:
            p, y, m = aligned(
                pred[o.name], arrays["observed"][o.name], arrays["mask"][o.name]
            )
            term = observation_model(o, values).loss(p, y, m)
            if o.family != "gaussian":
                term = o.weight * term
            total = total + term
        return total

    return loss
