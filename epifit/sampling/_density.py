"""The log posterior density NUTS samples: the fit's objective on the
unconstrained free vector, with each prior'd transform's log-Jacobian."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from epifit.fitting import Objective
from epifit.model import constrain, constrain_coefficients

__all__ = ["LogDensity"]


class LogDensity:
    """`log p(x | y) = -loss(x) + sum log|dc/dx|`, up to a constant.

    `loss` is calibrate's objective (the observations' negative
    log-likelihood plus the negative log-priors and penalties). A prior in a
    fit configuration is a density of the parameter's constrained value `c`;
    the sampler moves on the unconstrained `x` (`c = transform(x)`), so the
    density of `x` gains `log|dc/dx|` for every element of a parameter with a
    prior. A free parameter without a prior has a flat prior on `x` (the
    objective adds nothing for it): it needs data that pin it down, or the
    posterior is improper. The weights of a neural sub-model are their own
    unconstrained coordinates: their prior (by default a Gaussian, see
    `docs/calibration.md`) needs no Jacobian.

    Args:
        objective: the fit's objective (`epifit.fitting.Objective`).
    """

    def __init__(self, objective: Objective):
        self.objective = objective
        free = objective.free
        specs = {p.name: p for p in objective.problem.spec.parameters}
        self.jacobian_names = tuple(n for n in free.priors if n in specs)
        self._specs = specs

    def log_jacobian(self, x: Float[Array, " n"], data) -> Float[Array, ""]:
        """`sum log|dc/dx|` over the elements of the prior'd parameters."""
        params = self.objective.params(x, data)
        total = jnp.zeros((), x.dtype)
        for name in self.jacobian_names:
            p, u = self._specs[name], params[name]
            if p.per_time is not None:

                def c(u, p=p):
                    return constrain_coefficients(p, u)
            else:

                def c(u, p=p):
                    return constrain(p.transform, u, *p.bounds)

            value, slope = jax.jvp(c, (u,), (jnp.ones_like(u),))
            if jnp.shape(value) != jnp.shape(u):
                raise NotImplementedError(
                    f"parameter '{name}': its transform is not elementwise "
                    f"({jnp.shape(u)} -> {jnp.shape(value)}); no log-Jacobian"
                )
            total = total + jnp.sum(jnp.log(jnp.abs(slope)))
        return total

    def __call__(self, x: Float[Array, " n"], data) -> Float[Array, ""]:
        """The log density at `x`; `-inf` where the loss is not finite (a
        failed solve), so that NUTS rejects the point (a divergence)."""
        logp = -self.objective.loss(x, data) + self.log_jacobian(x, data)
        return jnp.where(jnp.isfinite(logp), logp, -jnp.inf)
