"""Observation noise for simulated data: draws from an observation's family
at the model's parameter values, with `jax.random`.

Written as functions of the family's name and its parameters (not of the
likelihood classes of `epifit.data`), so a simulation and a fit agree on what a
family means without sharing code:

- `poisson`: counts of mean `mean`;
- `negative_binomial`: counts of mean `mean` and variance
  `mean + mean^2 / dispersion` (a gamma-Poisson mixture, Stan's
  `neg_binomial_2`);
- `gaussian`: `mean + sd * z`, `z` standard normal, clipped at 0 (data are
  counts, never negative); a `least_squares` observation of weight `w` has
  `sd = sqrt(1 / (2 w))`.

Counts are whole numbers stored as float64. Cost: one draw per point (two for
the negative binomial), elementwise. `noise_quantile` gives the exact
quantiles of the same families (what a fit plot's predictive band draws):
a bisection over whole counts on the regularised incomplete gamma and beta
functions, about 40 elementwise evaluations.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:  # the CLI's parser reads OBSERVE without loading the model layer
    from epifit.model import ObservationSpec

__all__ = ["OBSERVE", "noise_of", "noise_quantile", "observation_key", "sample_noise"]

OBSERVE = ("model", "poisson", "negative_binomial", "gaussian")
"""What `--observe` takes: `model` (each observation's own family) or one
family for every observation."""


def sample_noise(
    key: jax.Array,
    family: str,
    mean: Any,
    *,
    dispersion: Any = None,
    sd: Any = None,
) -> np.ndarray:
    """Noisy observations of expected values `mean` (any shape, >= 0; tiny
    negative values of a solve are read as 0), as float64.

    Args:
        key: a `jax.random` key, or a NumPy `Generator`: the same families
            drawn by NumPy, with no program to compile (`jax.random.poisson`
            compiles a rejection sampler for every new shape: 1.95 s for
            the boarding school's 4 x 1000 x 14 posterior predictive draws).
        family: `poisson`, `negative_binomial` (needs `dispersion`) or
            `gaussian` (needs `sd`).
        mean: the expected values.
        dispersion, sd: the family's parameter, a scalar or an array that
            broadcasts against `mean` (per patch: `(patch,)`).

    Raises:
        ValueError: an unknown family, or its parameter missing or not > 0.
    """
    if isinstance(key, np.random.Generator):
        return _numpy_noise(key, family, mean, dispersion=dispersion, sd=sd)
    mean = jnp.maximum(jnp.asarray(mean, dtype=float), 0.0)
    if family == "poisson":
        y = jax.random.poisson(key, mean, shape=mean.shape)
    elif family == "negative_binomial":
        phi = _positive(family, "dispersion", dispersion, mean.shape)
        k_rate, k_count = jax.random.split(key)
        rate = jax.random.gamma(k_rate, phi, shape=mean.shape) * (mean / phi)
        y = jax.random.poisson(k_count, rate, shape=mean.shape)
    elif family == "gaussian":
        scale = _positive(family, "sd", sd, mean.shape)
        z = jax.random.normal(key, shape=mean.shape, dtype=mean.dtype)
        y = jnp.maximum(mean + scale * z, 0.0)
    else:
        raise _unknown(family)
    return np.asarray(y, dtype=np.float64)


def _numpy_noise(rng: np.random.Generator, family, mean, *, dispersion, sd):
    """`sample_noise`'s families drawn by NumPy's generator `rng`."""
    mean = np.maximum(np.asarray(mean, dtype=np.float64), 0.0)
    if family == "poisson":
        y = rng.poisson(mean)
    elif family == "negative_binomial":
        phi = np.asarray(_positive(family, "dispersion", dispersion, mean.shape))
        y = rng.poisson(rng.gamma(phi, mean / phi))
    elif family == "gaussian":
        scale = np.asarray(_positive(family, "sd", sd, mean.shape))
        y = np.maximum(mean + scale * rng.standard_normal(mean.shape), 0.0)
    else:
        raise _unknown(family)
    return np.asarray(y, dtype=np.float64)


def _unknown(family: str) -> ValueError:
    return ValueError(
        f"unknown noise family {family!r}; choose poisson, "
        "negative_binomial or gaussian"
    )


def noise_quantile(
    family: str,
    q: float,
    mean: Any,
    *,
    dispersion: Any = None,
    sd: Any = None,
) -> np.ndarray:
    """The `q`-quantile of the noise `sample_noise` draws around `mean`: the
    smallest whole count `k` with `P(Y <= k) >= q` (poisson, negative
    binomial), `max(mean + sd * z_q, 0)` (gaussian). NaN where `mean` is NaN.

    Raises:
        ValueError: `q` outside (0, 1), an unknown family, or its parameter
            missing or not > 0.
    """
    if not 0.0 < float(q) < 1.0:
        raise ValueError(f"a noise quantile needs a level in (0, 1); got {q!r}")
    raw = np.asarray(mean, dtype=np.float64)
    missing = ~np.isfinite(raw)
    mu = jnp.asarray(np.where(missing, 0.0, np.maximum(raw, 0.0)))
    if family == "gaussian":
        scale = _positive(family, "sd", sd, mu.shape)
        y = jnp.maximum(mu + scale * jax.scipy.special.ndtri(float(q)), 0.0)
    elif family == "poisson":
        y = _count_quantile(lambda k: jax.scipy.special.gammaincc(k + 1, mu), q, mu)
    elif family == "negative_binomial":
        phi = _positive(family, "dispersion", dispersion, mu.shape)
        p = phi / (phi + mu)
        cdf = lambda k: jax.scipy.special.betainc(phi, k + 1, p)  # noqa: E731
        y = _count_quantile(cdf, q, mu + mu**2 / phi)
    else:
        raise _unknown(family)
    return np.where(missing, np.nan, np.asarray(y, dtype=np.float64))


def _count_quantile(cdf, q: float, var) -> jax.Array:
    """The smallest whole `k >= 0` with `cdf(k) >= q`, by bisection on
    `[0, hi]`, `hi` far in the tail (mean + 40 sd + 40 > the quantile)."""
    hi = jnp.ceil(var + 40.0 * jnp.sqrt(var) + 40.0)  # var >= mean: cdf(hi) >= q
    lo = jnp.full(hi.shape, -1.0)  # cdf(lo) < q: P(Y <= -1) = 0
    for _ in range(int(np.ceil(np.log2(float(jnp.max(hi)) + 2.0))) + 1):
        mid = jnp.floor(0.5 * (lo + hi))
        above = cdf(jnp.maximum(mid, 0.0)) >= q
        above = above & (mid >= 0)
        lo, hi = jnp.where(above, lo, mid), jnp.where(above, mid, hi)
    return hi


def _positive(family: str, name: str, value, shape) -> jax.Array:
    if value is None:
        raise ValueError(f"{family} noise needs its {name}")
    arr = np.asarray(value, dtype=np.float64)
    if not (np.all(np.isfinite(arr)) and np.all(arr > 0)):
        raise ValueError(f"{family} noise needs a {name} > 0; got {arr.tolist()}")
    return jnp.broadcast_to(jnp.asarray(arr, dtype=float), shape)


def observation_key(seed: int, index: int) -> jax.Array:
    """The key of the `index`-th observation of a model for `seed`: the same
    seed gives the same draws, each observation its own stream."""
    return jax.random.fold_in(jax.random.key(seed), index)


def noise_of(
    obs: ObservationSpec, values: Mapping[str, Any], observe: str
) -> tuple[str, dict[str, Any]]:
    """`(family, parameters)` of the noise of `obs` for `observe` (one of
    `OBSERVE`), its parameters evaluated at the constrained `values`
    (parameters and derived quantities).

    `model` takes the observation's own family (`least_squares` drawn as
    `gaussian` of `sd = sqrt(1 / (2 weight))`); a named family replaces it,
    a gaussian taking the observation's `sd` (or that of a least-squares
    weight) and a negative binomial its `dispersion` parameter.

    Raises:
        ValueError: an unknown `observe`; a negative binomial for an
            observation without a dispersion parameter, or a gaussian for a
            poisson or negative binomial one (naming the observation and the
            flag).
    """
    if observe not in OBSERVE:
        raise ValueError(
            f"unknown --observe family {observe!r}; choose one of {list(OBSERVE)}"
        )
    family = obs.family if observe == "model" else observe
    if family == "least_squares":
        family = "gaussian"
    if family == "poisson":
        return family, {}
    if family == "negative_binomial":
        if obs.dispersion is None:
            raise ValueError(
                f"observation '{obs.name}' has no dispersion parameter, which "
                "--observe negative_binomial needs; give its [[observations]] "
                'dispersion = "NAME" (and family = "negative_binomial"), or '
                "choose another family"
            )
        return family, {"dispersion": np.asarray(values[obs.dispersion])}
    if family == "gaussian":
        if obs.sd is not None:
            return family, {"sd": np.asarray(obs.sd.evaluate(values))}
        if obs.family == "least_squares":
            return family, {"sd": np.asarray(np.sqrt(0.5 / obs.weight))}
        raise ValueError(
            f"observation '{obs.name}' ({obs.family}) has no sd, which --observe "
            'gaussian needs; give its [[observations]] family = "gaussian" and '
            'sd = "NAME", or choose another family'
        )
    raise ValueError(f"observation '{obs.name}': unknown family {family!r}")
