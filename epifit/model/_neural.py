"""Neural sub-models: an `eqx.nn.MLP` mapping a covariate's features to a rate."""

from __future__ import annotations

import copyreg
from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

from epifit.model._spec import NeuralSpec

__all__ = [
    "ACTIVATIONS",
    "canonical_activation",
    "make_mlp",
    "make_mlps",
    "neural_rates",
    "output_layer_mask",
]


# The activations are this module's own functions, each calling JAX's: an
# MLP holds its activations, and JAX's (jitted or custom_jvp wrappers) do not
# pickle, so an objective with a neural sub-model could not be sent to
# another process (`epifit.sample(chain_method="processes")`). The same
# operations are traced, so the compiled programs are unchanged.


def _identity(x: Array) -> Array:
    return x


def swish(x: Array) -> Array:
    """`jax.nn.swish` (`x * sigmoid(x)`, also called silu)."""
    return jax.nn.swish(x)


def relu(x: Array) -> Array:
    """`jax.nn.relu`."""
    return jax.nn.relu(x)


def tanh(x: Array) -> Array:
    """`jax.numpy.tanh`."""
    return jnp.tanh(x)


def softplus(x: Array) -> Array:
    """`jax.nn.softplus`."""
    return jax.nn.softplus(x)


def sigmoid(x: Array) -> Array:
    """`jax.nn.sigmoid`."""
    return jax.nn.sigmoid(x)


def _equinox_missing():
    """Equinox's `MISSING` sentinel, the one object its modules' unflatten
    code compares with `is`."""
    from equinox._module._flatten import MISSING

    return MISSING


def _pickle_missing_by_name() -> None:
    """Unpickle equinox's `MISSING` to itself: the tree structure of an
    equinox module holds it, and a plain pickle makes a new instance, which
    breaks the module's unflatten (`'_Missing' object is not subscriptable`)
    in a worker given a pickled objective. Skipped where equinox has no such
    sentinel."""
    try:
        missing = _equinox_missing()
    except ImportError:
        return
    copyreg.pickle(type(missing), lambda _: (_equinox_missing, ()))


_pickle_missing_by_name()


ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    "swish": swish,
    "silu": swish,
    "relu": relu,
    "tanh": tanh,
    "softplus": softplus,
    "sigmoid": sigmoid,
    "identity": _identity,
}
_ALIASES = {"silu": "swish"}  # jax.nn.silu is jax.nn.swish


def canonical_activation(name: str) -> str:
    """The canonical spelling of an activation (`silu` -> `swish`)."""
    return _ALIASES.get(name, name)


def make_mlp(
    spec: NeuralSpec, *, key: PRNGKeyArray | None = None, seed: int = 0
) -> eqx.nn.MLP:
    """Initialise the MLP of a neural sub-model (`out_size="scalar"`).

    With a JAX `key`, equinox's own initialisation (`jax.random`, a few small
    compiled operations per layer). Without one, the same distribution drawn
    with a NumPy generator seeded `seed`: every weight and bias of a layer
    with `n` inputs uniform on `(-1/sqrt(n), 1/sqrt(n))`, layer after layer,
    weight before bias. That path compiles nothing, so a cold fit's start-up
    does not wait on a dozen eager XLA compiles (`epifit/fitting/README.md`,
    the cost model).
    """

    def build(k):
        return eqx.nn.MLP(
            in_size=spec.in_size,
            out_size="scalar",
            width_size=spec.width,
            depth=spec.depth,
            activation=ACTIVATIONS[spec.activation],
            final_activation=ACTIVATIONS[spec.final_activation],
            key=k,
        )

    if key is not None:
        return build(key)
    # the structure only (traced, nothing compiled), then NumPy draws
    shapes = eqx.filter_eval_shape(lambda: build(jax.random.key(0)))
    rng = np.random.default_rng(seed)
    leaves = []
    for layer in shapes.layers:
        n_in = layer.weight.shape[1]
        lim = 1.0 / np.sqrt(n_in) if n_in else 1.0
        for a in (layer.weight, layer.bias):
            if a is not None:
                draw = rng.uniform(-lim, lim, a.shape).astype(a.dtype)
                leaves.append(jax.device_put(draw))  # (jnp.asarray compiles)
    return eqx.tree_at(_weights_and_biases, shapes, leaves)


def output_layer_mask(mlp: eqx.nn.MLP):
    """Bools for `eqx.partition` of an MLP whose hidden layers are fixed
    (`fixed = "hidden"`): True for the output layer's weight and bias only."""
    mask = jax.tree.map(lambda _: False, mlp)
    last = jax.tree.map(eqx.is_inexact_array, mlp.layers[-1])
    return eqx.tree_at(lambda m: m.layers[-1], mask, last)


def make_mlps(
    specs: Sequence[NeuralSpec], key: PRNGKeyArray | None = None
) -> dict[str, eqx.nn.MLP]:
    """The MLPs of a model's neural sub-models, by name: from `key` (one
    `jax.random.split` per sub-model, in spec order) or, without one, from
    NumPy generators seeded 0, 1, ... in spec order (nothing compiled)."""
    if not specs:
        return {}
    if key is None:
        return {n.name: make_mlp(n, seed=seed) for seed, n in enumerate(specs)}
    keys = jax.random.split(key, len(specs))
    return {n.name: make_mlp(n, key=k) for k, n in zip(keys, specs, strict=True)}


def _weights_and_biases(mlp: eqx.nn.MLP) -> list:
    return [
        a for layer in mlp.layers for a in (layer.weight, layer.bias) if a is not None
    ]


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
