"""Shared test helpers: tree comparison, a TOML writer, the reference problem."""

from __future__ import annotations

import datetime
import importlib.util
import json
import math
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest

from epifit.model import CompiledModel, ModelBuilder

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "models"
BENCHMARKS = REPO / "benchmarks"
# the external definitions the in-repo reference is cross-checked against,
# when present (`EPIFIT_SHARED_BENCH` points elsewhere, e.g. at a folder that
# does not exist to run the suite as a clone without them would)
SHARED_BENCH = Path(
    os.environ.get("EPIFIT_SHARED_BENCH") or REPO.parent / "shared" / "bench"
)

# rows of the reference state u (16, patch), as (compartment, stages)
REFERENCE_LAYOUT = (("S", 1), ("E", 1), ("ID", 7), ("D", 1), ("IR", 5), ("R", 1))


def tree_allclose(a: Any, b: Any, *, rtol: float = 1e-12, atol: float = 0.0) -> bool:
    """Same structure and every leaf close."""
    la, ta = jtu.tree_flatten(a)
    lb, tb = jtu.tree_flatten(b)
    if ta != tb:
        return False
    return all(
        np.shape(x) == np.shape(y) and np.allclose(x, y, rtol=rtol, atol=atol)
        for x, y in zip(la, lb, strict=True)
    )


# -- a minimal TOML writer (tests only; the library only reads TOML) ----------------
def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, datetime.date | datetime.time):  # TOML's own date/time values
        return v.isoformat()
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, Mapping):
        return (
            "{" + ", ".join(f"{_key(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
        )
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def _key(k: str) -> str:
    bare = k and all(c.isalnum() or c in "_-" for c in k) and k.isascii()
    return k if bare else json.dumps(k)


def to_toml(data: Mapping[str, Any]) -> str:
    """Write a dict as TOML: scalars and inline values at the top, then tables
    (`[name]`) and arrays of tables (`[[name]]`)."""
    lines = []
    tables = []
    for k, v in data.items():
        if isinstance(v, Mapping):
            tables.append((k, v))
        elif isinstance(v, list) and v and all(isinstance(x, Mapping) for x in v):
            tables.append((k, v))
        else:
            lines.append(f"{_key(k)} = {_toml_value(v)}")
    for k, v in tables:
        if isinstance(v, Mapping):
            lines.append(f"\n[{_key(k)}]")
            lines += [f"{_key(kk)} = {_toml_value(vv)}" for kk, vv in v.items()]
        else:
            for item in v:
                lines.append(f"\n[[{_key(k)}]]")
                lines += [f"{_key(kk)} = {_toml_value(vv)}" for kk, vv in item.items()]
    return "\n".join(lines) + "\n"


def builder_from_dict(data: Mapping[str, Any]) -> ModelBuilder:
    """Replay a TOML-layout description through the `ModelBuilder` methods."""
    b = ModelBuilder(data["name"], description=data.get("description"))
    for c in data.get("compartments", []):
        c = {"name": c} if isinstance(c, str) else c
        b.compartment(c["name"], c.get("stages", 1))
    for name, p in data.get("parameters", {}).items():
        b.parameter(name, **p)
    for name, e in data.get("derived", {}).items():
        b.derived(name, e)
    for name, c in data.get("covariates", {}).items():
        b.covariate(name, **c)
    for name, n in data.get("neural", {}).items():
        b.neural(name, **n)
    for name, c in data.get("couplings", {}).items():
        b.coupling(name, **c)
    for t in data.get("transitions", []):
        t = dict(t)
        b.transition(t.pop("from"), t.pop("to", None), **t)
    for i in data.get("infections", []):
        i = dict(i)
        b.infection(i.pop("from"), i.pop("to"), **i)
    for o in data.get("observations", []):
        o = dict(o)
        b.observation(o.pop("name"), o.pop("kind"), o.pop("compartments"), **o)
    for comp, v in data.get("initial", {}).items():
        if isinstance(v, Mapping):
            b.initial(comp, v.get("expression"), data=v.get("data"))
        else:
            b.initial(comp, v)
    return b


# -- the reference problem ---------------------------------------------------------
def import_benchmark(name: str):
    """Import `benchmarks/<name>` (a module or the `reference` package's
    `reference.problem`, `reference.peers`), with `benchmarks/` on `sys.path`
    as the benchmark scripts have it."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)


def reference_problem():
    """`benchmarks/reference/problem.py`: the reference problem (NumPy and JAX
    only)."""
    return import_benchmark("reference.problem")


def import_shared(name: str):
    """Import `<SHARED_BENCH>/<name>.py` under the name `shared_<name>`, or
    skip: the cross-check against the external definitions needs them."""
    path = SHARED_BENCH / f"{name}.py"
    if not path.exists():
        pytest.skip(
            f"{path} not found: the external reference is absent, so the in-repo "
            "one (benchmarks/reference/) is not cross-checked against it"
        )
    key = f"shared_{name}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    spec.loader.exec_module(module)
    return module


def reference_covariates(problem: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Reference arrays to day-major covariates: mobility `(n, 7, T) -> (T, n, 7)`,
    coupling `(n, n, T) -> (T, n, n)` (`C[t, p, q]`: q's infectious act on p)."""
    return {
        "mobility": np.ascontiguousarray(np.transpose(problem["mobility"], (2, 0, 1))),
        "coupling": np.ascontiguousarray(np.transpose(problem["coupling"], (2, 0, 1))),
    }


def reference_state(u: Any) -> dict[str, jnp.ndarray]:
    """Reference state `u (16, n)` or `(time, 16, n)` -> `{compartment: (stages, n)}`,
    with the stage axis second to last."""
    u = jnp.asarray(u)
    out, row = {}, 0
    for name, stages in REFERENCE_LAYOUT:
        out[name] = u[..., row : row + stages, :]
        row += stages
    return out


def state_to_reference(y: Mapping[str, Any]) -> jnp.ndarray:
    """Inverse of [`reference_state`][]."""
    return jnp.concatenate([y[name] for name, _ in REFERENCE_LAYOUT], axis=-2)


def reference_initial_data(u0: Any) -> dict[str, np.ndarray]:
    """Reference `u0 (16, n)` -> the data variables of `[initial]` in
    `models/seird_metapop_mobility.toml` (`initial_S (n,)`, `initial_ID (7, n)`...)."""
    u0 = np.asarray(u0)
    out, row = {}, 0
    for name, stages in REFERENCE_LAYOUT:
        block = u0[row : row + stages]
        out[f"initial_{name}"] = block[0] if stages == 1 else block
        row += stages
    return out


def params_from_flat(model: CompiledModel, p_flat: Any, n_patches: int) -> dict:
    """The reference flat vector `p_` as a parameter pytree of
    `models/seird_metapop_mobility.toml` (both in unconstrained coordinates).

    `p_[:3]` -> kappa, alpha, gamma; `p_[3:3+n]` -> scaler; `p_[3+n:]` -> the MLP
    `beta`, per layer `W (out, in)` row-major, then `b (out,)`.
    """
    p = jnp.asarray(p_flat)
    params = model.init_params(n_patches)
    params["kappa"], params["alpha"], params["gamma"] = p[0], p[1], p[2]
    params["scaler"] = p[3 : 3 + n_patches]
    mlp = params["beta"]
    off = 3 + n_patches
    for k, layer in enumerate(mlp.layers):
        n_out, n_in = layer.weight.shape
        w = p[off : off + n_out * n_in].reshape(n_out, n_in)
        off += n_out * n_in
        b = p[off : off + n_out]
        off += n_out
        mlp = eqx.tree_at(
            lambda m, k=k: (m.layers[k].weight, m.layers[k].bias), mlp, (w, b)
        )
    if off != p.shape[0]:
        raise ValueError(f"p_flat has {p.shape[0]} entries; the model uses {off}")
    params["beta"] = mlp
    return params


def backward_traces(monkeypatch) -> list:
    """A list that grows by one each time the checkpoint adjoint's backward
    pass (`CheckpointAdjoint.segment_backward`) is traced: empty where a
    derivative came from forward mode alone."""
    from epifit.ode import CheckpointAdjoint

    traced = []
    backward = CheckpointAdjoint.segment_backward

    def counted(self, *args):
        traced.append(1)
        return backward(self, *args)

    monkeypatch.setattr(CheckpointAdjoint, "segment_backward", counted)
    return traced
