"""The log posterior density NUTS samples: the fit's objective on the
unconstrained free vector, with each prior'd transform's log-Jacobian."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from epifit.fitting import Objective
from epifit.model import constrain, constrain_coefficients
from epifit.ode import forward_gradient

__all__ = ["LogDensity", "Whitened", "whitening"]


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

    Its gradient is taken in forward mode where that is cheaper (a few
    parameters and a small state: `Objective.forward_pays`), else by the
    solver settings' adjoint; `gradient` says which (`"forward"` or
    `"adjoint"`). A NUTS run takes thousands of gradients, so their cost is
    what counts; a calibration takes tens to hundreds, where the compile
    (the same either way) dominates, and keeps the adjoint.

    Args:
        objective: the fit's objective (`epifit.fitting.Objective`).
    """

    def __init__(self, objective: Objective):
        self.objective = objective
        self.gradient = "forward" if objective.forward_pays else "adjoint"
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
        value = self._value
        if self.gradient == "forward":
            value = forward_gradient(value)
        logp = value(x, data)
        return jnp.where(jnp.isfinite(logp), logp, -jnp.inf)

    def _value(self, x, data):
        return -self.objective.loss(x, data) + self.log_jacobian(x, data)


class Whitened:
    """`density` on whitened coordinates `z`, `x = shift + root @ z`.

    The Laplace approximation's affine map (`shift` the MAP, `root` a square
    root of its covariance, `root @ root.T = covariance`): where the
    approximation is good the posterior of `z` is close to a standard normal,
    whatever the scales of `x`. Window adaptation needs that: blackjax (like
    Stan and numpyro) regularises each estimated mass matrix towards `1e-3`
    times the identity, `n / (n + 5) cov + 1e-3 * 5 / (n + 5) I`, which on a
    posterior with standard deviations of 1e-3 or less (rates that 20 patches
    of counts pin down) swamps the estimate and forces short steps and deep
    trees. The Jacobian `|det root|` is a constant and is left out, so the
    log density at `z` is the one at `x`, and so are `lp` and the energy.
    `objective` is the wrapped density's (the chains' data come from it).
    """

    def __init__(self, density, shift, root):
        self.density = density
        self.objective = density.objective
        self.shift = np.asarray(shift, np.float64)
        self.root = np.asarray(root, np.float64)

    def to_x(self, z: Float[Array, " n"]) -> Float[Array, " n"]:
        dt = jnp.asarray(z).dtype
        return jnp.asarray(self.shift, dt) + jnp.asarray(self.root, dt) @ z

    def __call__(self, z: Float[Array, " n"], data) -> Float[Array, ""]:
        return self.density(self.to_x(z), data)


def whitening(covariance) -> tuple[np.ndarray, np.ndarray] | None:
    """`(root, inverse)` with `root @ root.T = covariance` (its eigenvectors
    scaled by the square roots of its eigenvalues, the root `start_points`
    draws with), or None for a covariance that cannot whiten: missing, not
    finite, or not positive definite to 1e-12 of its largest eigenvalue."""
    if covariance is None:
        return None
    cov = np.asarray(covariance, np.float64)
    if cov.ndim != 2 or not np.all(np.isfinite(cov)):
        return None
    w, v = np.linalg.eigh((cov + cov.T) / 2)
    if w.size == 0 or w.min() <= 1e-12 * w.max():
        return None
    s = np.sqrt(w)
    return v * s, (v / s).T
