"""Priors of the free parameters: the densities, their defaults and their
records (what `FIT.nc` stores).

Every free parameter has a prior, so the objective is a negative log
posterior and a fit is a maximum a posteriori (MAP) fit:

* **declared** in the fit configuration (`[parameters] NAME.prior`): `normal`
  or `lognormal` on the constrained value ([`Normal`][], [`LogNormal`][]);
  for a neural sub-model, `normal` on every weight and bias
  ([`WeightPrior`][]), or `l2 = λ` (weight decay, the same Gaussian with
  `sd = 1 / sqrt(2 λ)`);
* **neural weights by default**: `Normal(0, sd)` on every weight and bias of
  each layer with `sd = NEURAL_PRIOR_GAIN / sqrt(fan_in)` (`fan_in` the
  layer's input size), `NEURAL_PRIOR_GAIN = 3`: five times the spread of
  equinox's initialisation (uniform on `±1 / sqrt(fan_in)`, sd
  `1 / sqrt(3 fan_in)`), so weakly informative, and proper, which is what makes
  the Hessian of the posterior over an over-parameterised MLP invertible;
* **time-varying parameters** with `smoothing` (declared in the model): the
  random-walk prior on their increments (the first `order` coefficients
  flat);
* **any other parameter**: flat on its unconstrained scale (an improper
  prior: its MAP value is its maximum-likelihood value, so fits of models
  without declared priors and without neural sub-models are unchanged). A
  parameter the data do not identify then has no curvature, and the Laplace
  approximation names it (see `_uncertainty.py`).

Declare `prior = { family = "flat" }` to keep a neural sub-model's weights
unpenalised (the fits before priors were defaults).
"""

from __future__ import annotations

import abc
import math
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, Float

from epifit.fitting._config import PriorConfig

__all__ = [
    "AbstractGaussianPrior",
    "AbstractPrior",
    "LogNormal",
    "NEURAL_PRIOR_GAIN",
    "Normal",
    "WeightPrior",
    "check_prior_records",
    "default_weight_prior",
    "make_prior",
    "prior_record",
]

NEURAL_PRIOR_GAIN = 3.0
"""The default prior of a neural weight or bias is `Normal(0, gain / sqrt(fan_in))`."""


class AbstractPrior(eqx.Module):
    """A prior on a parameter's constrained value; `nll` is its negative
    log-density (up to a constant), summed over the elements."""

    @abc.abstractmethod
    def nll(self, value) -> Float[Array, ""]: ...


class AbstractGaussianPrior(AbstractPrior):
    """Marks priors whose `nll` is a sum of squares of `residuals`, so that
    least-squares methods (Gauss-Newton, Levenberg-Marquardt) can use them."""

    @abc.abstractmethod
    def residuals(self, value) -> Float[Array, " n"]: ...


class Normal(AbstractGaussianPrior):
    """`value ~ Normal(mean, sd)` on the constrained scale."""

    mean: float
    sd: float

    def __check_init__(self):
        if not self.sd > 0:
            raise ValueError(f"Normal prior needs sd > 0; got sd={self.sd}.")

    def residuals(self, value):
        return jnp.ravel((value - self.mean) / (self.sd * math.sqrt(2.0)))

    def nll(self, value):
        return jnp.sum(jnp.square(self.residuals(value)))


class LogNormal(AbstractPrior):
    """`log(value) ~ Normal(log(median), sdlog)`: a prior for positive values."""

    median: float
    sdlog: float

    def __check_init__(self):
        if not (self.median > 0 and self.sdlog > 0):
            raise ValueError(
                "LogNormal prior needs median > 0 and sdlog > 0; got "
                f"median={self.median}, sdlog={self.sdlog}."
            )

    def nll(self, value):
        z = (jnp.log(value) - math.log(self.median)) / self.sdlog
        return jnp.sum(0.5 * jnp.square(z) + jnp.log(value))


class WeightPrior(AbstractGaussianPrior):
    """Independent `Normal(mean, sd)` priors on the array leaves of a neural
    sub-model (its weights and biases, as the model uses them: neural
    sub-models are not transformed), one `sd` per leaf in `jax.tree.leaves`
    order of `eqx.filter(mlp, eqx.is_inexact_array)`.

    Attributes:
        mean: the prior mean of every weight.
        sds: one standard deviation per leaf.
        leaves: the leaves' paths (`layers[0].weight`), for the records.
        source: `default` or `fit` (declared in the fit configuration).
    """

    mean: float
    sds: tuple[float, ...]
    leaves: tuple[str, ...] = ()
    source: str = "default"

    def __check_init__(self):
        if not all(s > 0 for s in self.sds):
            raise ValueError(f"WeightPrior needs every sd > 0; got {self.sds}.")

    def _arrays(self, module) -> list[Array]:
        arrays = jtu.tree_leaves(eqx.filter(module, eqx.is_inexact_array))
        if len(arrays) != len(self.sds):
            raise ValueError(
                f"WeightPrior has {len(self.sds)} standard deviations for a "
                f"neural sub-model with {len(arrays)} weight arrays."
            )
        return arrays

    def residuals(self, value):
        parts = [
            jnp.ravel((w - self.mean) / (sd * math.sqrt(2.0)))
            for w, sd in zip(self._arrays(value), self.sds, strict=True)
        ]
        return jnp.concatenate(parts) if parts else jnp.zeros((0,))

    def nll(self, value):
        return jnp.sum(jnp.square(self.residuals(value)))


def _leaf_paths(module) -> list[tuple[str, Any]]:
    arrays = eqx.filter(module, eqx.is_inexact_array)
    return [
        (jtu.keystr(path).lstrip("."), leaf)
        for path, leaf in jtu.tree_flatten_with_path(arrays)[0]
    ]


def default_weight_prior(
    module, gain: float = NEURAL_PRIOR_GAIN, mean: float = 0.0, sd: float | None = None
) -> WeightPrior:
    """The prior of a neural sub-model's weights: `Normal(mean, sd)` for every
    leaf when `sd` is given (declared), else `Normal(0, gain / sqrt(fan_in))`
    per layer (a layer's weight `(out, in)` and its bias share `fan_in = in`;
    any other array leaf gets `gain`)."""
    paths = _leaf_paths(module)
    if sd is not None:
        return WeightPrior(
            float(mean), (float(sd),) * len(paths), tuple(p for p, _ in paths), "fit"
        )
    fan_in: dict[str, int] = {}
    for path, leaf in paths:
        if path.endswith(".weight") and jnp.ndim(leaf) >= 1:
            fan_in[path[: -len("weight")]] = int(jnp.shape(leaf)[-1])
    sds = []
    for path, _ in paths:
        stem = path.rsplit(".", 1)[0] + "." if "." in path else ""
        n = fan_in.get(stem, 1)
        sds.append(float(gain) / math.sqrt(n))
    return WeightPrior(0.0, tuple(sds), tuple(p for p, _ in paths), "default")


def make_prior(config: PriorConfig) -> AbstractPrior | None:
    """The prior a fit configuration declares on a parameter (None: flat)."""
    if config.family == "flat":
        return None
    if config.family == "normal":
        return Normal(config.a, config.b)
    return LogNormal(config.a, config.b)


# ------------------------------------------------------------------ records
def prior_record(prior, *, source: str = "fit", smoothing=None) -> dict[str, Any]:
    """A plain description of a parameter's prior, as `FIT.nc` stores it:
    `family`, its numbers, what it is on (`constrained`, `unconstrained`,
    `weights`, `increments`) and its `source` (`fit`, `model`, `default`)."""
    if smoothing is not None:
        return {
            "family": "random_walk",
            "order": int(smoothing.order),
            "sd": float(smoothing.sd),
            "on": "increments",
            "source": "model",
        }
    if prior is None:
        return {"family": "flat", "on": "unconstrained", "source": source}
    if isinstance(prior, Normal):
        return {
            "family": "normal",
            "mean": float(prior.mean),
            "sd": float(prior.sd),
            "on": "constrained",
            "source": source,
        }
    if isinstance(prior, LogNormal):
        return {
            "family": "lognormal",
            "median": float(prior.median),
            "sdlog": float(prior.sdlog),
            "on": "constrained",
            "source": source,
        }
    if isinstance(prior, WeightPrior):
        return {
            "family": "normal",
            "mean": float(prior.mean),
            "sd": {p: float(s) for p, s in zip(prior.leaves, prior.sds, strict=True)},
            "on": "weights",
            "source": prior.source,
        }
    raise TypeError(f"no record for a prior of type {type(prior).__name__}")


_FIELDS = {
    "normal": ("mean", "sd"),
    "lognormal": ("median", "sdlog"),
    "flat": (),
    "random_walk": ("order", "sd"),
}


def _positive(v) -> bool:
    if isinstance(v, dict):
        return bool(v) and all(_positive(u) for u in v.values())
    return isinstance(v, int | float) and not isinstance(v, bool) and v > 0


def check_prior_records(records: Any, names) -> str:
    """Why `records` (a `FIT.nc`'s `priors`) are not one valid record per
    free parameter in `names`, else ""."""
    if not isinstance(records, dict):
        return "attribute 'priors' is not a JSON object"
    missing = sorted(set(names) - set(records))
    if missing:
        return f"attribute 'priors' has no prior for {', '.join(missing)}"
    for name, r in records.items():
        if not isinstance(r, dict) or r.get("family") not in _FIELDS:
            return f"attribute 'priors': '{name}' has no known family ({r!r})"
        for key in _FIELDS[r["family"]]:
            if key not in r:
                return f"attribute 'priors': '{name}' has no '{key}'"
        scale = r.get("sd", r.get("sdlog", 1.0))
        if r["family"] != "flat" and not _positive(scale):
            return f"attribute 'priors': '{name}' has a scale that is not > 0"
    return ""
