"""Neural sub-models: an `eqx.nn.MLP` mapping a covariate's features to a rate."""

from __future__ import annotations

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from epifit.model._spec import NeuralSpec

__all__ = ["ACTIVATIONS", "canonical_activation", "make_mlp", "neural_rates"]


def _identity(x: Array) -> Array:
    return x


ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    "swish": jax.nn.swish,
    "silu": jax.nn.silu,
    "relu": jax.nn.relu,
    "tanh": jnp.tanh,
    "softplus": jax.nn.softplus,
    "sigmoid": jax.nn.sigmoid,
    "identity": _identity,
}
_ALIASES = {"silu": "swish"}  # jax.nn.silu is jax.nn.swish


def canonical_activation(name: str) -> str:
    """The canonical spelling of an activation (`silu` -> `swish`)."""
    return _ALIASES.get(name, name)


def make_mlp(spec: NeuralSpec, *, key: PRNGKeyArray) -> eqx.nn.MLP:
    """Initialise the MLP of a neural sub-model (`out_size="scalar"`)."""
    return eqx.nn.MLP(
        in_size=spec.in_size,
        out_size="scalar",
        width_size=spec.width,
        depth=spec.depth,
        activation=ACTIVATIONS[spec.activation],
        final_activation=ACTIVATIONS[spec.final_activation],
        key=key,
    )


def neural_rates(
    spec: NeuralSpec,
    mlp: eqx.nn.MLP,
    features: Float[Array, "time patch feature"],
    days: Float[Array, " time"],
) -> Float[Array, "time patch"]:
    """Evaluate the MLP once for every (day, patch), vectorised with `vmap`.

    With `time_input`, the day's grid time is appended as a last feature.
    """
    if spec.time_input:
        n_time, n_patch, _ = features.shape
        t = jnp.broadcast_to(
            days.astype(features.dtype)[:, None, None], (n_time, n_patch, 1)
        )
        features = jnp.concatenate([features, t], axis=-1)
    return jax.vmap(jax.vmap(mlp))(features)
