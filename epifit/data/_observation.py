"""Observation models (likelihood families) for counts on the save grid.

Every family has the same interface: `log_likelihood(predicted, observed, mask)`
and `loss(predicted, observed, mask)`, both scalars summed over all points, and
`point_log_likelihood` (the same arguments), the log-likelihood of each point.
Masked points (and NaN observations, which always count as missing) contribute
exactly nothing to the value *and* to the gradient: both the prediction and the
observation are replaced by harmless values before any arithmetic (the "double
`where`"), so neither a NaN observation nor a log of zero can leak into a
gradient through the unselected branch.

Cost: every method is jitted and elementwise plus one sum, linear in the
number of points; the gradient costs a small multiple of the value.
"""

import abc

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import gammaln
from jaxtyping import Array, ArrayLike, Bool, Float, Real

from epifit._checks import check_positive as _check_positive

Scalar = Float[Array, ""]


class AbstractObservationModel(eqx.Module):
    """A likelihood family for observations given model predictions (means).

    `predicted` and `observed` have the same shape (e.g. `(time, patch)`);
    `mask` (optional, same shape) is `True` where an observation counts. NaN
    observations are always treated as missing. A family implements
    `point_log_likelihood` and `loss`; `log_likelihood` is the sum of the
    points'.
    """

    @abc.abstractmethod
    def point_log_likelihood(
        self,
        predicted: Real[ArrayLike, "*shape"],
        observed: Real[ArrayLike, "*shape"],
        mask: Bool[ArrayLike, "*shape"] | None = None,
    ) -> Float[Array, "*shape"]:
        """The log-likelihood of every point (exactly 0 where masked or NaN)."""

    @jax.jit
    def log_likelihood(
        self,
        predicted: Real[ArrayLike, "*shape"],
        observed: Real[ArrayLike, "*shape"],
        mask: Bool[ArrayLike, "*shape"] | None = None,
    ) -> Scalar:
        """Sum of the log-likelihoods of the unmasked points (`weight` does
        not enter it)."""
        return jnp.sum(self.point_log_likelihood(predicted, observed, mask))

    @abc.abstractmethod
    def loss(
        self,
        predicted: Real[ArrayLike, "*shape"],
        observed: Real[ArrayLike, "*shape"],
        mask: Bool[ArrayLike, "*shape"] | None = None,
    ) -> Scalar:
        """A loss to minimise: the negative log-likelihood up to a constant."""


class _AbstractWeightedLikelihood(AbstractObservationModel):
    """A family whose loss is its whole negative log-likelihood times the
    observation's relative `weight`."""

    weight: eqx.AbstractVar[float]

    @jax.jit
    def loss(self, predicted, observed, mask=None) -> Scalar:
        return self.weight * -self.log_likelihood(predicted, observed, mask)


class Gaussian(AbstractObservationModel):
    """Normal noise with standard deviation `sigma`: (weighted) least squares.

    For a standard deviation that is fitted (or any true log-likelihood in
    the loss) use [`Normal`][epifit.data.Normal]: this loss leaves out the
    `log(sigma)` term, so it is a loss for fixed weights only.

    Give either `sigma` or `weight = 1 / (2 sigma^2)`; each may be a scalar or
    an array broadcast against the observations (per-point weights). `loss` is
    the weighted sum of squares

    `sum(weight * (predicted - observed)^2)`,

    which is the negative log-likelihood without its constant
    `-sum(log(weight / pi)) / 2`. The reference metapopulation problem's loss is
    `Gaussian(weight=1.0).loss` on new infections plus
    `Gaussian(weight=20000.0).loss` on new deaths.

    Examples:
        >>> import jax.numpy as jnp
        >>> predicted, observed = jnp.array([1.0, 2.0]), jnp.array([0.0, 4.0])
        >>> float(Gaussian(weight=2.0).loss(predicted, observed))  # 2 * (1 + 4)
        10.0
    """

    weight: Array

    def __init__(
        self, sigma: ArrayLike | None = None, *, weight: ArrayLike | None = None
    ):
        if (sigma is None) == (weight is None):
            raise ValueError(
                "Gaussian needs exactly one of sigma (noise standard deviation) or "
                "weight (1 / (2 sigma^2), the least-squares weight); got "
                f"sigma={sigma!r}, weight={weight!r}."
            )
        if sigma is not None:
            _check_positive("Gaussian", "sigma", sigma)
            self.weight = 0.5 / jnp.square(jnp.asarray(sigma))
        else:
            _check_positive("Gaussian", "weight", weight)
            self.weight = jnp.asarray(weight)

    @property
    def sigma(self) -> Array:
        """The noise standard deviation, `sqrt(1 / (2 weight))`."""
        return jnp.sqrt(0.5 / self.weight)

    @jax.jit
    def point_log_likelihood(self, predicted, observed, mask=None) -> Array:
        predicted, observed, mask = _prepare(predicted, observed, mask)
        weight = jnp.where(mask, jnp.broadcast_to(self.weight, observed.shape), 1.0)
        residual = predicted - observed
        point = -weight * jnp.square(residual) + 0.5 * jnp.log(weight / jnp.pi)
        return jnp.where(mask, point, 0.0)

    @jax.jit
    def loss(self, predicted, observed, mask=None) -> Scalar:
        predicted, observed, mask = _prepare(predicted, observed, mask)
        weight = jnp.broadcast_to(self.weight, observed.shape)
        point = weight * jnp.square(predicted - observed)
        return jnp.sum(jnp.where(mask, point, 0.0))


class Normal(_AbstractWeightedLikelihood):
    """Normal noise of standard deviation `sd`: a true log-likelihood.

    `sd` may be a scalar or an array broadcast against the observations (e.g.
    `(1, patch)` against `(time, patch)`), and a traced (fitted) value: unlike
    `Gaussian` (least squares, whose loss leaves out the normalising
    constant), the loss keeps the `log(sd)` term, so a fitted `sd` has a
    maximum at the residuals' root mean square. `log_likelihood` is the sum of
    `scipy.stats.norm.logpdf(observed, predicted, sd)` over the unmasked
    points; `loss` is `weight * -log_likelihood` (`weight`, default 1, the
    observation's relative weight in a fit).

    Examples:
        >>> import jax.numpy as jnp
        >>> ll = Normal(1.0).log_likelihood(jnp.array([0.0]), jnp.array([0.0]))
        >>> round(float(ll), 4)  # -log(2 pi) / 2
        -0.9189
    """

    sd: Array
    weight: float

    def __init__(self, sd: ArrayLike, *, weight: float = 1.0):
        _check_positive("Normal", "sd", sd)
        _check_positive("Normal", "weight", weight)
        self.sd = jnp.asarray(sd)
        self.weight = weight

    @jax.jit
    def point_log_likelihood(self, predicted, observed, mask=None) -> Array:
        predicted, observed, mask = _prepare(predicted, observed, mask)
        sd = jnp.where(mask, jnp.broadcast_to(self.sd, observed.shape), 1.0)
        z = (observed - predicted) / sd
        point = -0.5 * jnp.square(z) - jnp.log(sd) - 0.5 * np.log(2.0 * np.pi)
        return jnp.where(mask, point, 0.0)


class Poisson(_AbstractWeightedLikelihood):
    """Poisson counts with mean `predicted` (which must be >= 0).

    `loss` is the negative log-likelihood times `weight` (default 1), the
    observation's relative weight in a fit; `log_likelihood` is unweighted.

    Examples:
        >>> import jax.numpy as jnp
        >>> ll = Poisson().log_likelihood(jnp.array([2.0]), jnp.array([0.0]))
        >>> round(float(ll), 4)  # log P(0 | mean 2) = -2
        -2.0
    """

    weight: float = 1.0

    def __check_init__(self):
        _check_positive("Poisson", "weight", self.weight)

    @jax.jit
    def point_log_likelihood(self, predicted, observed, mask=None) -> Array:
        predicted, observed, mask = _prepare(predicted, observed, mask)
        point = _xlogy(observed, predicted) - predicted - gammaln(observed + 1.0)
        return jnp.where(mask, point, 0.0)


class NegativeBinomial(_AbstractWeightedLikelihood):
    """Negative binomial counts with mean `predicted` and a `dispersion` phi.

    The variance is `mean + mean^2 / dispersion` (Stan's `neg_binomial_2`, the
    parametrisation of renewal-model tools such as EpiNow2); a large dispersion
    approaches the Poisson. In SciPy's terms this is
    `nbinom(n=dispersion, p=dispersion / (dispersion + mean))`. `dispersion` may
    be a scalar or an array broadcast against the observations, and a traced
    (fitted) value. `loss` is the negative log-likelihood times `weight`
    (default 1), the observation's relative weight in a fit; `log_likelihood`
    is unweighted.
    """

    dispersion: Array
    weight: float

    def __init__(self, dispersion: ArrayLike, *, weight: float = 1.0):
        _check_positive("NegativeBinomial", "dispersion", dispersion)
        _check_positive("NegativeBinomial", "weight", weight)
        self.dispersion = jnp.asarray(dispersion)
        self.weight = weight

    @jax.jit
    def point_log_likelihood(self, predicted, observed, mask=None) -> Array:
        predicted, observed, mask = _prepare(predicted, observed, mask)
        phi = jnp.where(mask, jnp.broadcast_to(self.dispersion, observed.shape), 1.0)
        point = (
            gammaln(observed + phi)
            - gammaln(phi)
            - gammaln(observed + 1.0)
            - phi * jnp.log1p(predicted / phi)
            + _xlogy(observed, predicted)
            - observed * jnp.log(phi + predicted)
        )
        return jnp.where(mask, point, 0.0)


def _prepare(predicted, observed, mask):
    """Arrays of one shape, with masked points replaced by harmless values."""
    predicted = jnp.asarray(predicted)
    observed = jnp.asarray(observed)
    if predicted.shape != observed.shape:
        raise ValueError(
            f"predicted has shape {predicted.shape} but observed has shape "
            f"{observed.shape}; they must match (select or reshape the model "
            "output onto the observation grid first)."
        )
    present = jnp.isfinite(observed)
    if mask is not None:
        mask = jnp.asarray(mask)
        if mask.shape != observed.shape:
            raise ValueError(
                f"mask has shape {mask.shape} but observed has shape {observed.shape}."
            )
        if mask.dtype != jnp.bool_:
            raise TypeError(f"mask must be boolean; got dtype {mask.dtype}.")
        present = present & mask
    dtype = jnp.result_type(predicted, observed, float)
    predicted = jnp.where(present, predicted.astype(dtype), 1.0)
    observed = jnp.where(present, observed.astype(dtype), 0.0)
    return predicted, observed, present


def _xlogy(x, y):
    """`x * log(y)`, `0` where `x == 0`, with a gradient that is finite there."""
    nonzero = x != 0
    return jnp.where(nonzero, x * jnp.log(jnp.where(nonzero, y, 1.0)), 0.0)
