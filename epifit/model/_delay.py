"""Reporting delays: discretised delay distributions and causal convolution."""

import abc

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.scipy.special import gammainc, gammaln, logsumexp
from jax.scipy.stats import norm
from jaxtyping import Array, ArrayLike, Float, Real

from epifit._checks import check_positive as _check_positive


class AbstractDelay(eqx.Module):
    """A continuous delay distribution (in days), discretised to whole days.

    `pmf()` gives the probabilities of a delay of `0, 1, ..., max_delay` days.
    Day `d` collects the probability that the continuous delay rounds to `d`:

    `p[0] = F(1/2)`, `p[d] = F(d + 1/2) - F(d - 1/2)`,

    computed as differences of the CDF `F` and renormalised by `F(max_delay +
    1/2)` (truncation), so they sum to 1. Rounding to the nearest day keeps the
    mean: the discretised mean equals the continuous one up to the truncated
    tail and a discretisation error that is small for smooth densities, and the
    variance gains about `1/12` (Sheppard's correction).

    Subclasses are parametrised by `mean` and `sd`, which may be traced
    (fitted); `max_delay` is static. `pmf()` costs `max_delay + 1` evaluations
    of the CDF.
    """

    mean: eqx.AbstractVar[Array]
    sd: eqx.AbstractVar[Array]
    max_delay: eqx.AbstractVar[int]

    @abc.abstractmethod
    def cdf(self, x: Real[ArrayLike, "*shape"]) -> Float[Array, "*shape"]:
        """The CDF of the continuous delay at `x > 0` days."""

    @jax.jit
    def pmf(self) -> Float[Array, " delay"]:
        """Probabilities of delays `0, ..., max_delay` days, summing to 1."""
        edges = jnp.arange(self.max_delay + 1, dtype=jnp.result_type(float)) + 0.5
        cumulative = self.cdf(edges)
        return jnp.diff(cumulative, prepend=0.0) / cumulative[-1]


def _check_delay(cls: str, mean, sd, max_delay) -> None:
    _check_positive(cls, "mean", mean)
    _check_positive(cls, "sd", sd)
    if isinstance(max_delay, bool) or not isinstance(max_delay, int) or max_delay < 0:
        raise ValueError(
            f"{cls}(max_delay=...) must be an integer number of days >= 0; got "
            f"{max_delay!r}."
        )


class GammaDelay(AbstractDelay):
    """A gamma-distributed delay with the given `mean` and `sd` (days).

    Shape `(mean / sd)^2`, scale `sd^2 / mean`; truncated at `max_delay` days.

    Examples:
        >>> p = GammaDelay(mean=5.0, sd=2.0, max_delay=20).pmf()
        >>> p.shape, round(float(p.sum()), 6)
        ((21,), 1.0)
    """

    mean: Array
    sd: Array
    max_delay: int = eqx.field(static=True)

    def __init__(self, mean: ArrayLike, sd: ArrayLike, max_delay: int):
        _check_delay("GammaDelay", mean, sd, max_delay)
        self.mean = jnp.asarray(mean)
        self.sd = jnp.asarray(sd)
        self.max_delay = max_delay

    def cdf(self, x):
        shape = jnp.square(self.mean / self.sd)
        scale = jnp.square(self.sd) / self.mean
        return regularized_gamma_p(shape, jnp.asarray(x) / scale)


# terms of the series of `_gamma_p_series`: enough for x <= _X_MAX
_N_TERMS = 1024
_X_MAX = 700.0


@jax.custom_jvp
def regularized_gamma_p(a: Array, x: Array) -> Array:
    """The regularised lower incomplete gamma function `P(a, x)` (the gamma
    CDF), differentiable to every order in both arguments.

    The value is `jax.scipy.special.gammainc`'s (accurate in the tails too).
    `gammainc` has no second derivative in `a`, which the Hessian of a fit
    whose delay mean is free needs, so the derivative in `a` is that of the
    series `P(a, x) = sum_k exp((a + k) log x - x - lgamma(a + k + 1))`
    (`_gamma_p_series`, elementary, hence differentiable again), and the
    derivative in `x` is the gamma density.
    """
    return gammainc(a, x)


@regularized_gamma_p.defjvp
def _regularized_gamma_p_jvp(primals, tangents):
    a, x = primals
    da, dx = tangents
    p = regularized_gamma_p(a, x)
    _, dp_da = jax.jvp(lambda a: _gamma_p_series(a, x), (a,), (da,))
    x_safe = jnp.where(x > 0, x, 1.0)
    density = jnp.where(
        x > 0, jnp.exp((a - 1.0) * jnp.log(x_safe) - x_safe - gammaln(a)), 0.0
    )
    return p, dp_da + density * dx


def _gamma_p_series(a: Array, x: Array) -> Array:
    """`P(a, x)` by its series in log space over a fixed 1024 terms: double
    precision for `x <= 700` (larger `x` are clipped there, where `P = 1` for
    shapes `a < 400`). Cost: 1024 `lgamma` evaluations per point."""
    x = jnp.clip(jnp.asarray(x), jnp.finfo(jnp.result_type(x, float)).tiny, _X_MAX)
    a, x = jnp.broadcast_arrays(jnp.asarray(a, x.dtype), x)
    a, x = a[..., None], x[..., None]
    k = jnp.arange(_N_TERMS, dtype=x.dtype).reshape((1,) * (x.ndim - 1) + (-1,))
    log_terms = (a + k) * jnp.log(x) - x - gammaln(a + k + 1.0)
    return jnp.exp(logsumexp(log_terms, axis=-1))


class LogNormalDelay(AbstractDelay):
    """A log-normal delay with the given `mean` and `sd` (days, not log-days).

    `sigma^2 = log(1 + (sd / mean)^2)`, `mu = log(mean) - sigma^2 / 2`;
    truncated at `max_delay` days.
    """

    mean: Array
    sd: Array
    max_delay: int = eqx.field(static=True)

    def __init__(self, mean: ArrayLike, sd: ArrayLike, max_delay: int):
        _check_delay("LogNormalDelay", mean, sd, max_delay)
        self.mean = jnp.asarray(mean)
        self.sd = jnp.asarray(sd)
        self.max_delay = max_delay

    def cdf(self, x):
        sigma2 = jnp.log1p(jnp.square(self.sd / self.mean))
        mu = jnp.log(self.mean) - 0.5 * sigma2
        return norm.cdf((jnp.log(x) - mu) / jnp.sqrt(sigma2))


@jax.jit
def convolve_delay(
    incidence: Float[ArrayLike, " time *rest"],
    pmf: Float[ArrayLike, " delay"] | AbstractDelay,
) -> Float[Array, " time *rest"]:
    """Delay incidence causally: `reported[t] = sum_d pmf[d] * incidence[t - d]`.

    The sum runs over `d = 0, ..., min(t, max_delay)`: incidence before the
    first day is taken as zero, so the first `max_delay` days of reports miss
    the infections before the window (start the simulation earlier if that
    matters). Along `time` (the leading axis) this is
    `numpy.convolve(incidence, pmf)[:len(incidence)]`, applied to every series
    of the trailing axes (e.g. `patch`).

    Cost: the sum over delays is unrolled at trace time (`max_delay` is small
    and static): `min(D + 1, time)` shifted copies of `incidence`, so time,
    memory traffic and program size grow linearly with `D`.

    Args:
        incidence: events per day, leading axis `time`.
        pmf: delay probabilities for `0, 1, ..., D` days, or a delay
            distribution such as [`GammaDelay`][epifit.data.GammaDelay].

    Returns:
        Delayed events, same shape as `incidence`.

    Examples:
        >>> import jax.numpy as jnp
        >>> x = convolve_delay(jnp.array([1.0, 0.0, 0.0, 2.0]), jnp.array([0.5, 0.5]))
        >>> x.tolist()
        [0.5, 0.5, 0.0, 1.0]
    """
    if isinstance(pmf, AbstractDelay):
        pmf = pmf.pmf()
    incidence = jnp.asarray(incidence)
    pmf = jnp.asarray(pmf)
    if incidence.ndim == 0:
        raise ValueError("incidence needs a leading time axis; got a scalar.")
    if pmf.ndim != 1:
        raise ValueError(f"pmf must be 1-D (delays 0..D); got shape {pmf.shape}.")
    n_time = incidence.shape[0]
    reported = jnp.zeros(incidence.shape, jnp.result_type(incidence, pmf))
    for d in range(min(pmf.shape[0], n_time)):  # unrolled: D is small and static
        shifted = jnp.concatenate(
            [
                jnp.zeros((d,) + incidence.shape[1:], incidence.dtype),
                incidence[: n_time - d],
            ]
        )
        reported = reported + pmf[d] * shifted
    return reported
