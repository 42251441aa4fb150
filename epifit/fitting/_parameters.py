"""The parameters a fit moves: free/fixed partition, priors, penalties, starts.

The optimisers see one flat vector `x` of the free entries of the parameter
pytree, in unconstrained coordinates (transforms map it to the constrained
scale, so bounds always hold). Fixed parameters, the non-array leaves of neural
sub-models (activations) and everything else stay outside `x` and never move.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, Float

from epifit._flat import ravel
from epifit._toml import read_values_file
from epifit.fitting._config import FitConfig, FitConfigError
from epifit.fitting._priors import (
    AbstractGaussianPrior,
    AbstractPrior,
    LogNormal,
    Normal,
    WeightPrior,
    default_weight_prior,
    make_prior,
    prior_record,
)
from epifit.fitting._result import FitResult
from epifit.model import coefficient_labels, random_walk_nll, random_walk_residuals
from epifit.simulation import Problem, load_params

__all__ = [
    "AbstractPrior",
    "AbstractGaussianPrior",
    "FreeParameters",
    "LogNormal",
    "Normal",
    "make_prior",
    "problem_labels",
    "time_labels",
]


# --------------------------------------------------------------- free parameters
def time_labels(model) -> dict[str, list[str]]:
    """The labels along time of each time-varying parameter's coefficients
    (`t0, t1, ...`; `c0, a1, b1, ...` for a periodic one)."""
    return {
        p.name: coefficient_labels(p.per_time, model.n_coefficients(p.name))
        for p in model.spec.parameters
        if p.per_time is not None
    }


def problem_labels(problem: Problem, tree) -> tuple[list[str], list[str]]:
    """[`leaf_labels`][] of a parameter pytree of `problem`'s model."""
    spec = problem.spec
    per_patch = {p.name for p in spec.parameters if p.per_patch}
    strata = {}
    if spec.strata is not None:  # per_stratum: labelled by stratum (and patch)
        strata = {p.name: spec.strata.labels for p in spec.parameters if p.per_stratum}
    return leaf_labels(
        tree, problem.patches, per_patch, time_labels(problem.model), strata
    )


def leaf_labels(
    tree,
    patches,
    per_patch,
    per_time: Mapping[str, list[str]] | None = None,
    per_stratum: Mapping[str, Sequence[str]] | None = None,
) -> tuple[list[str], list[str]]:
    """A label for every element of every array leaf of a parameter pytree (in
    `ravel_pytree` order) and the parameter each belongs to; the coefficients
    of a time-varying parameter (`per_time`: name -> labels along time, see
    [`time_labels`][]) are `beta[t0]`, or `beta[t0, north]` per patch."""
    labels, names = [], []
    per_time, per_stratum = per_time or {}, per_stratum or {}
    for path, leaf in jtu.tree_flatten_with_path(tree)[0]:
        name = str(path[0].key)
        base = name + jtu.keystr(tuple(path[1:]))
        arr = np.asarray(leaf)
        if name in per_stratum:  # (stratum,) or (patch, stratum)
            strata = per_stratum[name]
            if arr.ndim == 2:
                labels += [f"{name}[{p}, {s}]" for p in patches for s in strata]
            else:
                labels += [f"{name}[{s}]" for s in strata]
        elif name in per_time:
            along = per_time[name]
            if arr.ndim == 2:
                labels += [f"{name}[{t}, {p}]" for t in along for p in patches]
            else:
                labels += [f"{name}[{t}]" for t in along]
        elif name in per_patch and arr.ndim == 1:
            labels += [f"{name}[{p}]" for p in patches]
        elif arr.ndim == 0:
            labels.append(base)
        else:
            labels += [
                f"{base}[{','.join(map(str, i))}]" for i in np.ndindex(arr.shape)
            ]
        names += [name] * arr.size
    return labels, names


class FreeParameters:
    """The free entries of a parameter pytree as one flat vector.

    Attributes:
        x0: the flat free vector of the initial parameters.
        n: its size.
        labels: one label per entry (`beta`, `scaler[north]`,
            `beta_mlp.layers[0].weight[2,1]`).
        names: the parameter (or neural sub-model) each entry belongs to.
        rest: the array leaves outside `x` (fixed values), passed to compiled
            functions as traced data.
    """

    def __init__(self, problem: Problem, params, config: FitConfig | None = None):
        model = problem.model
        mask = model.free_mask(params)
        free, rest = eqx.partition(params, mask)
        self.problem = problem
        self.template = params
        # in NumPy: no program compiled for the set-up (epifit/_flat.py)
        flat, self._unravel = ravel(free)
        self.x0 = jax.device_put(flat)
        self.rest, self._static = eqx.partition(rest, eqx.is_array)
        self.n = int(self.x0.size)
        labels, names = problem_labels(problem, free)
        self.labels = tuple(labels)
        self.names = tuple(names)
        config = FitConfig() if config is None else config
        self.priors: dict[str, AbstractPrior] = {}
        self.l2: dict[str, float] = {}
        flat = set()  # declared flat
        for name, o in config.parameters.items():
            if o.prior is not None and (prior := make_prior(o.prior)) is not None:
                self.priors[name] = prior
            elif o.prior is not None:
                flat.add(name)
            if o.l2:
                self.l2[name] = float(o.l2)
        # the weights of free neural sub-models: a declared normal prior on
        # every weight, or l2, or flat, else the default (see `_priors.py`)
        for n in problem.spec.neural:
            if n.name not in self.names:
                continue
            declared = self.priors.pop(n.name, None)
            if n.name in flat or n.name in self.l2:
                continue
            self.priors[n.name] = default_weight_prior(
                params[n.name],
                mean=0.0 if declared is None else declared.mean,
                sd=None if declared is None else declared.sd,
            )
        # random-walk priors of the free time-varying parameters
        self.smoothing = {
            p.name: p.smoothing
            for p in problem.spec.parameters
            if p.smoothing is not None and not p.fixed
        }
        # a smoothing prior's exact density has a constant that no sum of
        # squares holds: the default methods then use the exact loss
        self.least_squares_penalty = not self.smoothing and all(
            isinstance(p, AbstractGaussianPrior) for p in self.priors.values()
        )
        self.records = self._records(flat)

    def _records(self, flat: set[str]) -> dict[str, dict]:
        """The prior of every free parameter (see `prior_record`)."""
        out = {}
        for name in dict.fromkeys(self.names):
            if name in self.smoothing:
                out[name] = prior_record(None, smoothing=self.smoothing[name])
            elif name in self.l2:
                sd = 1.0 / math.sqrt(2.0 * self.l2[name])
                out[name] = {**prior_record(Normal(0.0, sd)), "on": "unconstrained"}
                out[name]["l2"] = self.l2[name]
            elif name in self.priors:
                out[name] = prior_record(self.priors[name])
            else:
                source = "fit" if name in flat else "default"
                out[name] = prior_record(None, source=source)
        return out

    def params(self, x: Float[Array, " n"], rest) -> Any:
        """The full parameter pytree for free vector `x` and fixed leaves `rest`."""
        return eqx.combine(self._unravel(x), rest, self._static)

    def flatten(self, params) -> Float[Array, " n"]:
        """The free vector of a parameter pytree of the same structure."""
        free, _ = eqx.partition(params, self.problem.model.free_mask(params))
        return ravel(free)[0]

    def penalty(self, x, rest) -> Float[Array, ""]:
        """Negative log-prior plus L2 penalties (0 when there are none), the
        random-walk priors of time-varying parameters included (their exact
        negative log-density, on the unconstrained coefficients)."""
        total = jnp.zeros((), self.x0.dtype)
        if not (self.priors or self.l2 or self.smoothing):
            return total
        params = self.params(x, rest)
        for name, smoothing in self.smoothing.items():
            total = total + random_walk_nll(smoothing, params[name])
        if self.priors:
            values = self.problem.model.constrain(params)
            for name, prior in self.priors.items():
                on = params if isinstance(prior, WeightPrior) else values
                total = total + prior.nll(on[name])
        for name, lam in self.l2.items():
            leaves = jtu.tree_leaves(eqx.filter(params[name], eqx.is_inexact_array))
            total = total + lam * sum(jnp.sum(jnp.square(v)) for v in leaves)
        return total

    def penalty_residuals(self, x, rest) -> Float[Array, " m"]:
        """Residuals whose sum of squares is `penalty` (Gaussian priors and L2;
        a random-walk prior's up to its constant, `log(sd) + log(2 pi) / 2`
        per increment)."""
        parts = [jnp.zeros((0,), self.x0.dtype)]
        params = self.params(x, rest)
        for name, smoothing in self.smoothing.items():
            parts.append(random_walk_residuals(smoothing, params[name]))
        if self.priors:
            values = self.problem.model.constrain(params)
            for name, prior in self.priors.items():
                if not isinstance(prior, AbstractGaussianPrior):
                    raise NotImplementedError(
                        f"The {type(prior).__name__} prior on '{name}' is not a sum "
                        "of squares; least-squares methods (gauss_newton, "
                        "levenberg_marquardt) cannot use it. Use a normal prior, or "
                        "the lbfgs or adam optimisers."
                    )
                on = params if isinstance(prior, WeightPrior) else values
                parts.append(prior.residuals(on[name]))
        for name, lam in self.l2.items():
            leaves = jtu.tree_leaves(eqx.filter(params[name], eqx.is_inexact_array))
            parts += [math.sqrt(lam) * jnp.ravel(v) for v in leaves]
        return jnp.concatenate(parts)

    def starts(
        self,
        x0: Float[Array, " n"],
        n_starts: int,
        perturbation: float,
        seed: int,
        draw: int = 0,
    ) -> Float[Array, "start n"]:
        """`n_starts` initial points: `x0` itself, then `x0` plus seeded normal
        perturbations of standard deviation `perturbation` (unconstrained).
        `draw > 0` gives a further, independent set of perturbations from the
        same seed (for starts drawn again)."""
        if n_starts == 1:
            return jax.device_put(np.asarray(x0)[None, :])
        key = jr.key(seed) if draw == 0 else jr.fold_in(jr.key(seed), draw)
        noise = np.asarray(jr.normal(key, (n_starts - 1, self.n), x0.dtype))
        # the arithmetic in NumPy: the same numbers, no eager programs
        x = np.asarray(x0)[None, :]
        return jax.device_put(np.concatenate([x, x + perturbation * noise]))


def constrained_dict(problem: Problem, params) -> dict[str, Any]:
    """Constrained parameter values and derived quantities as NumPy (neural
    sub-models left out)."""
    values = problem.model.constrain(params)
    neural = {n.name for n in problem.spec.neural}
    return {k: np.asarray(v) for k, v in values.items() if k not in neural}


def starting_params(problem: Problem, init, values) -> dict:
    """The model's initial parameters, or `init`, with constrained `values`."""
    if isinstance(init, FitResult):
        init = init.params
    if init is None:
        params = problem.init_params()
    else:
        expected = {p.name for p in problem.spec.parameters}
        expected |= {n.name for n in problem.spec.neural}
        if not isinstance(init, Mapping) or set(init) != expected:
            got = sorted(init) if isinstance(init, Mapping) else type(init).__name__
            raise TypeError(
                "init must be an unconstrained parameter pytree with entries "
                f"{sorted(expected)} (e.g. problem.init_params() or a FitResult's "
                f"params), or a FitResult; got {got}. For constrained values use "
                "values={name: value}."
            )
        template = problem.init_params()
        for k in expected:
            a, b = jax.tree.structure(init[k]), jax.tree.structure(template[k])
            shapes = [np.shape(v) for v in jax.tree.leaves(init[k])]
            want = [np.shape(v) for v in jax.tree.leaves(template[k])]
            if a != b or shapes != want:
                raise ValueError(
                    f"init['{k}'] has shapes {shapes}; the problem needs {want}."
                )
        params = dict(init)
    if values is None:
        return params
    if isinstance(values, str | os.PathLike):
        path = Path(values)
        given = read_values_file(
            path,
            lambda e: FitConfigError(
                f"cannot parse parameter values: {e}", file=str(path)
            ),
        )
    elif isinstance(values, Mapping):
        given = dict(values)
    else:
        raise TypeError(
            f"values must be a mapping or a TOML/JSON file; got {type(values)}."
        )
    new = load_params(problem, given)  # validates names and shapes
    return {**params, **{k: new[k] for k in given}}


def free_entries(params, mask) -> np.ndarray:
    """A bool per array element of `params`: is it free?"""
    arrays, _ = eqx.partition(params, eqx.is_inexact_array)
    flags = jax.tree.map(
        lambda a, m: None if a is None else np.full(np.shape(a), bool(m)),
        arrays,
        mask,
        is_leaf=lambda v: v is None,
    )
    leaves = [np.ravel(f) for f in jax.tree.leaves(flags)]
    return np.concatenate(leaves) if leaves else np.zeros((0,), bool)
