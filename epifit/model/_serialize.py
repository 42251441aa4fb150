"""Constrained parameter values as JSON, for the attributes of output files."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import numpy as np

from epifit.model._spec import ModelSpec


def parameters_json(spec: ModelSpec, constrained: Mapping[str, Any]) -> dict[str, str]:
    """`{"parameters": ..., "derived_parameters": ...}`, both JSON texts.

    `constrained` holds the model's constrained values (`CompiledModel.constrain`).
    Declared parameters appear as numbers (per-patch ones as lists), neural
    sub-models as their layers' `weight (out, in)` and `bias (out,)`, derived
    parameters as numbers.
    """
    values: dict[str, Any] = {p.name: constrained[p.name] for p in spec.parameters}
    values |= {n.name: _mlp_layers(constrained[n.name]) for n in spec.neural}
    derived = {d.name: constrained[d.name] for d in spec.derived}
    return {
        "parameters": json.dumps(_plain(values)),
        "derived_parameters": json.dumps(_plain(derived)),
    }


def _mlp_layers(mlp: eqx.nn.MLP) -> dict[str, Any]:
    return {
        "layers": [
            {"weight": np.asarray(layer.weight), "bias": np.asarray(layer.bias)}
            for layer in mlp.layers
        ]
    }


def _plain(tree: Any) -> Any:
    """Nested dicts and lists of Python floats, as `json.dumps` takes them."""
    if isinstance(tree, Mapping):
        return {str(k): _plain(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return [_plain(v) for v in tree]
    return np.asarray(tree, np.float64).tolist()
