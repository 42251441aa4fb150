"""Synthetic metapopulation datasets from known parameters (`synthetic_metapopulation`).

The generator follows the synthetic problem of the reference benchmark
(`benchmarks/reference/problem.py`), written in epifit's conventions: patches at
random points of the unit square, sparse k-nearest-neighbour gravity coupling
with a slow modulation, smooth mobility features with a lockdown dip, a true MLP
calibrated so that the transmission rate rises with mobility within a realistic
range, a few seeded patches, a tight float64 solve with the model layer, and
observation noise on counts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import xarray as xr

from epifit._schema import FEATURE, PATCH, PATCH_TO, POPULATION, STAGE, TIME
from epifit.model import CompiledModel, ModelSpec, as_model, parameters_json
from epifit.simulation._run import ModelRun
from epifit.simulation._settings import SolverSettings
from epifit.simulation._synthetic_covariates import draw_covariates

__all__ = ["synthetic_metapopulation"]

Noise = Literal["poisson", "negative_binomial", "gaussian", "none"]
NOISES: tuple[str, ...] = ("poisson", "negative_binomial", "gaussian", "none")
DEFAULT_DISPERSION = {"negative_binomial": 10.0, "gaussian": 0.1}
START = np.datetime64("2020-03-01", "D")  # day 0 of every synthetic dataset
RATE_RANGE = (0.22, 0.55)  # 2nd-98th percentiles of a true neural rate, /day
SEED_FRACTION = (2e-4, 1e-3)  # initially infected fraction of a seeded patch
# the truth is solved far below any noise level: Tsit5 at rtol 1e-10, atol 1e-13
TRUTH_SETTINGS = SolverSettings(rtol=1e-10, atol=1e-13, max_steps=100_000)
_INVERSE = {  # inverses of monotone final activations, to place the rate range
    "softplus": lambda y: y + np.log(-np.expm1(-y)),
    "identity": lambda y: y,
    "relu": lambda y: y,
    "sigmoid": lambda y: np.log(y) - np.log1p(-y),
    "tanh": np.arctanh,
}


def synthetic_metapopulation(
    model: str | os.PathLike[str] | ModelSpec | CompiledModel,
    n_patches: int,
    n_days: int,
    *,
    seed: int,
    noise: Noise = "poisson",
    dispersion: float | None = None,
    params: Mapping[str, Any] | None = None,
) -> tuple[xr.Dataset, dict[str, Any]]:
    """A synthetic metapopulation epidemic, simulated from known parameters.

    Everything is drawn from `numpy.random.default_rng(seed)`: the result is a
    pure function of the arguments, for any number of patches and days.

    - **Patches** `p00, p01, ...` at uniform points of the unit square;
      `population (patch)` is `round(1e5 * lognormal(0, 1))`, at least 1000.
    - **Coupling** covariates `(time, patch, patch_to)`: gravity weights
      `population[q] * exp(-distance / 0.1)` to the 10 nearest neighbours,
      normalised to row sums `U(0.05, 0.3)`, times a slow modulation (a
      lockdown factor 1 -> 0.5 around day 22, partial reopening around day 70,
      a weekly +-10 % rhythm, +-20 % drift per patch); a `(patch, patch_to)`
      covariate gets the unmodulated weights.
    - **Mobility** covariates `(time, patch, feature)`: smooth, in `[0, 1]`,
      dipping around day 20 and recovering after day 70.
    - **True parameters**: the model file's values; a per-patch parameter with
      no upper bound is spread as `lower + (value - lower) * U(0.7, 1.3)`. Each
      neural sub-model gets random weights (sd `1/sqrt(in_size)`, biases sd
      0.1), its output layer sign-fixed so the rate rises with mean mobility
      and set so the 2nd-98th percentiles of the rate over all days and
      patches are 0.22-0.55 /day. `params` overrides any of these.
    - **Initial state**: the `[initial]` variables read from data, e.g.
      `initial_S (patch)`, `initial_ID (stage_ID, patch)` (a dim
      `stage_<compartment>` per box-car chain). 5 % of the patches (at least
      2) get `U(2e-4, 1e-3)` of their population in the infected compartment
      of the first infection; the rest is susceptible.
    - **Observations**: the model is solved in float64 with `TRUTH_SETTINGS`
      (Tsit5 at `rtol = 1e-10`, `atol = 1e-13`); each observed series (with
      its ascertainment) is stored noise-free as `true_<name>` and with noise
      as `<name>`. Incidence has no value on day 0 (NaN).

    **Units.** Observations are counts. A model in fractions of each patch
    (no infection normalised by a population, as `seird_metapop_mobility.toml`)
    is scaled: the expected count is `population * prediction`, and a fit must
    scale the same way (attribute `observation_scale = "population"`). A model
    in counts is used as it is (`"none"`), its initial state `population`
    times the fractions above; `population` is left out when it reads neither
    it nor initial data (it has its own, such as `N`).

    **Noise** on the expected counts `mu`, whatever the model's likelihood:
    `poisson`; `negative_binomial` with `dispersion` phi (variance `mu + mu^2 /
    phi`, default 10); `gaussian` with sd `dispersion * mean(mu)` per series
    (default 0.1), clipped at 0; `none` (the truth clipped at 0).

    Args:
        model: a TOML path, a `ModelSpec` or a `CompiledModel`.
        n_patches: the number of patches (>= 1).
        n_days: the number of days (>= 2).
        seed: seeds `numpy.random.default_rng`.
        noise: the observation noise.
        dispersion: the noise's dispersion (see above); only for
            `negative_binomial` and `gaussian`.
        params: constrained true values overriding the drawn ones, by name
            (an `eqx.nn.MLP` for a neural sub-model, a list per patch).

    Returns:
        `(dataset, true_params)`: the dataset (observations, `true_<name>`,
        covariates, `population`, initial-state variables; attributes
        `true_parameters` and `true_derived`, JSON of the constrained values,
        MLPs as `{"layers": [{"weight": [[...]], "bias": [...]}, ...]}`) and
        the true parameters, unconstrained, as from `model.init_params`.

    Raises:
        ValueError: for a bad size, noise, dispersion or parameter name.
        NotImplementedError: for a covariate the generator cannot invent (dims
            other than those above, or a `(patch,)` one not named
            `population`) or a neural output activation it cannot invert.

    Examples:
        >>> ds, truth = synthetic_metapopulation(
        ...     "models/seird_metapop_mobility.toml", 3, 10, seed=0)
        >>> dict(ds["new_infections"].sizes)
        {'time': 10, 'patch': 3}
        >>> bool(ds["new_deaths"].isel(time=0).isnull().all())
        True
    """
    compiled = as_model(model)
    _check_arguments(n_patches, n_days, seed, noise, dispersion)
    if dispersion is None:
        dispersion = DEFAULT_DISPERSION.get(noise)
    rng = np.random.default_rng(seed)
    with jax.enable_x64(True):
        truth = _simulate_truth(compiled, rng, n_patches, n_days, params)
        observed = {
            k: _add_noise(rng, v, noise, dispersion) for k, v in truth.expected.items()
        }
    ds = _assemble(compiled.spec, n_days, truth, observed)
    about = dict(seed=seed, noise=noise, dispersion=dispersion)
    ds.attrs.update(_attributes(compiled.spec, truth, **about))
    return ds, truth.params


class _Truth(NamedTuple):
    """The drawn world and its noise-free observations."""

    covariates: dict[str, np.ndarray]
    population: np.ndarray | None  # None: the model has its own
    initial: dict[str, np.ndarray]
    params: Any  # unconstrained
    constrained: Any  # the true values, `model.constrain(params)`
    counts_model: bool
    expected: dict[str, np.ndarray]  # expected counts, (time, patch)


def _simulate_truth(compiled: CompiledModel, rng, n_patches, n_days, params):
    """Patches, covariates, true parameters and initial state drawn from
    `rng` (in this order), then solved: the expected counts."""
    spec = compiled.spec
    xy = rng.uniform(0.0, 1.0, size=(n_patches, 2))
    population = np.maximum(
        np.round(1e5 * rng.lognormal(0.0, 1.0, size=n_patches)), 1000.0
    )
    covariates = draw_covariates(spec, rng, xy, population, n_days)
    values = _true_values(compiled, rng, n_patches, covariates, params)
    true_params = compiled.unconstrain(values)
    counts = any(i.normalize == "population" for i in spec.infections)
    initial = _initial_data(spec, rng, n_patches, population if counts else None)
    expected = _solve(compiled, true_params, covariates, initial, n_patches, n_days)
    scale = np.ones(n_patches) if counts else population
    expected = {k: v * scale[None, :] for k, v in expected.items()}
    if counts and not initial and POPULATION not in covariates:
        population = None  # the model has its own; a drawn one would mislead
    constrained = compiled.constrain(true_params)
    return _Truth(
        covariates, population, initial, true_params, constrained, counts, expected
    )


def _attributes(spec, truth: _Truth, *, seed, noise, dispersion) -> dict[str, Any]:
    """The dataset's attributes: what made it, and the true values as JSON."""
    as_json = parameters_json(spec, truth.constrained)
    n_days, n_patches = next(iter(truth.expected.values())).shape
    return {
        "title": f"Synthetic metapopulation epidemic, model '{spec.name}', "
        f"{n_patches} patches, {n_days} days",
        "source": "epifit.simulation.synthetic_metapopulation",
        "comment": _comment(truth.counts_model, noise),
        "Conventions": "CF-1.8",
        "model": spec.name,
        "model_text": _model_text(spec),
        "seed": int(seed),
        "noise": noise,
        "dispersion": "none" if dispersion is None else float(dispersion),
        "observation_units": "counts",
        "observation_scale": "none" if truth.counts_model else POPULATION,
        "true_parameters": as_json["parameters"],
        "true_derived": as_json["derived_parameters"],
    }


# -- arguments ----------------------------------------------------------------------
def _check_arguments(n_patches, n_days, seed, noise, dispersion) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
        raise TypeError(f"seed must be an int; got {seed!r}.")
    for name, value, least in (("n_patches", n_patches, 1), ("n_days", n_days, 2)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise TypeError(f"{name} must be an int; got {value!r}.")
        if value < least:
            raise ValueError(f"{name} must be >= {least}; got {value}.")
    if noise not in NOISES:
        raise ValueError(f"Unknown noise {noise!r}; choose one of {list(NOISES)}.")
    if dispersion is not None:
        if noise not in DEFAULT_DISPERSION:
            raise ValueError(
                f"noise={noise!r} has no dispersion; got dispersion={dispersion}. "
                f"Give a dispersion only with noise in {list(DEFAULT_DISPERSION)}."
            )
        if not dispersion > 0:
            raise ValueError(f"dispersion must be > 0; got {dispersion}.")


# -- true parameters ----------------------------------------------------------------
def _true_values(model: CompiledModel, rng, n, covariates, params) -> dict[str, Any]:
    spec = model.spec
    values: dict[str, Any] = {}
    for p in spec.parameters:
        v = np.broadcast_to(
            np.asarray(p.value, np.float64), (n,) if p.per_patch else ()
        )
        lower, upper = p.bounds
        spread = rng.uniform(0.7, 1.3, size=n)
        if p.per_patch and np.isinf(upper) and np.isfinite(lower):
            v = lower + (v - lower) * spread
        values[p.name] = jnp.asarray(v, jnp.float64)
    template = model.init_params(n, key=jax.random.key(0))
    for m in spec.neural:
        values[m.name] = _true_mlp(m, template[m.name], rng, covariates[m.covariate])
    known = [p.name for p in spec.parameters] + [m.name for m in spec.neural]
    unknown = sorted(set(params or {}) - set(known))
    if unknown:
        raise ValueError(f"Unknown parameters {unknown}; the model has {known}.")
    for name, v in (params or {}).items():
        if isinstance(v, eqx.Module):
            values[name] = jax.tree.map(
                lambda x: jnp.asarray(x, jnp.float64) if eqx.is_array_like(x) else x,
                v,
            )
            continue
        arr = jnp.asarray(v, jnp.float64)
        if arr.shape not in ((), values[name].shape):
            raise ValueError(
                f"Parameter {name!r} has shape {arr.shape}; expected "
                f"{values[name].shape} (or a scalar)."
            )
        values[name] = jnp.broadcast_to(arr, values[name].shape)
    return values


def _true_mlp(m, mlp: eqx.nn.MLP, rng, features: np.ndarray) -> eqx.nn.MLP:
    """Random weights; the output layer set so the rate rises with mobility and
    spans `RATE_RANGE` (2nd-98th percentiles over all days and patches)."""
    if m.final_activation not in _INVERSE:
        raise NotImplementedError(
            f"Neural sub-model {m.name!r}: cannot place a rate range through final "
            f"activation {m.final_activation!r}; use one of {sorted(_INVERSE)} or "
            "pass the true MLP in params."
        )
    layers = []
    for layer in mlp.layers:
        n_out, n_in = layer.weight.shape
        w = rng.normal(0.0, 1.0 / np.sqrt(n_in), size=(n_out, n_in))
        layers.append((w, rng.normal(0.0, 0.1, size=n_out)))
    x = features
    if m.time_input:
        days = np.broadcast_to(
            np.arange(x.shape[0], dtype=np.float64)[:, None, None], x.shape[:2] + (1,)
        )
        x = np.concatenate([x, days], axis=-1)
    activation = mlp.activation
    h = x
    for w, b in layers[:-1]:
        h = np.asarray(activation(jnp.asarray(h @ w.T + b)))
    w, b = layers[-1]
    z = (h @ w.T + b)[..., 0]
    if np.corrcoef(z.ravel(), features.mean(axis=-1).ravel())[0, 1] < 0:
        w, b = -w, -b  # transmission rises with mobility
        z = -z
    lo, hi = np.percentile(z, [2.0, 98.0])
    inverse = _INVERSE[m.final_activation]
    zlo, zhi = inverse(RATE_RANGE[0]), inverse(RATE_RANGE[1])
    gain = (zhi - zlo) / max(hi - lo, 1e-12)
    layers[-1] = (w * gain, (b - lo) * gain + zlo)
    for k, (w, b) in enumerate(layers):
        mlp = eqx.tree_at(
            lambda t, k=k: (t.layers[k].weight, t.layers[k].bias),
            mlp,
            (jnp.asarray(w, jnp.float64), jnp.asarray(b, jnp.float64)),
        )
    return mlp


# -- initial state, solve, noise ----------------------------------------------------
def _initial_data(spec: ModelSpec, rng, n: int, counts) -> dict[str, np.ndarray]:
    """`[initial]` variables read from data, as fractions of each patch (times
    `counts`, the population, for a model in counts)."""
    stages = {c.name: c.stages for c in spec.compartments}
    susceptible = {i.source for i in spec.infections}
    seeded_into = spec.infections[0].target if spec.infections else None
    n_seed = min(n, max(2, round(0.05 * n)))
    seeded = rng.choice(n, size=n_seed, replace=False)
    seed = np.zeros(n)
    seed[seeded] = rng.uniform(*SEED_FRACTION, size=n_seed)
    scale = np.ones(n) if counts is None else counts
    out = {}
    for i in spec.initial:
        if i.data is None:
            continue
        first = np.zeros(n)
        if i.compartment in susceptible:
            first = 1.0 - seed
        elif i.compartment == seeded_into:
            first = seed
        k = stages[i.compartment]
        value = np.zeros((k, n))
        value[0] = first * scale
        out[i.data] = value[0] if k == 1 else value
    return out


def _solve(model: CompiledModel, params, covariates, initial, n, n_days):
    """Noise-free observed series `(time, patch)`, NaN on day 0 for incidence."""
    cov = {k: jnp.asarray(v, jnp.float64) for k, v in covariates.items()}
    init = {k: jnp.asarray(v, jnp.float64) for k, v in initial.items()}
    series = _observed_series(model, params, cov, init, n, n_days)
    out = {}
    for name in (o.name for o in model.observations):  # in model order
        s = np.asarray(series[name], np.float64)
        if s.shape[0] == n_days - 1:  # incidence: no value before the first day
            s = np.concatenate([np.full((1, n), np.nan), s], axis=0)
        out[name] = s
    return out


@eqx.filter_jit
def _observed_series(model: CompiledModel, params, cov, initial, n, n_days):
    # compiled once per (model, sizes): the covariates and parameters are traced
    ts = np.arange(n_days, dtype=np.float64)
    run = ModelRun(model, ts, n, jnp.float64, TRUTH_SETTINGS, broadcast_rates=False)
    sol = run(params, cov, {**cov, **initial})
    return model.observe(sol.ys, params)


def _add_noise(rng, mu: np.ndarray, noise: str, dispersion) -> np.ndarray:
    missing = np.isnan(mu)
    lam = _significant(np.where(missing, 0.0, np.maximum(mu, 0.0)))
    if noise == "poisson":
        y = rng.poisson(lam).astype(np.float64)
    elif noise == "negative_binomial":
        y = rng.negative_binomial(dispersion, dispersion / (dispersion + lam))
        y = y.astype(np.float64)
    elif noise == "gaussian":
        sd = dispersion * lam[~missing].mean() if (~missing).any() else 0.0
        y = np.maximum(lam + sd * rng.standard_normal(lam.shape), 0.0)
    else:
        y = lam
    return np.where(missing, np.nan, y)


def _significant(x: np.ndarray, digits: int = 6) -> np.ndarray:
    """`x` rounded to `digits` significant digits.

    Poisson and negative binomial samplers consume a number of random draws that
    depends on the mean, so a round-off difference in the solve (another CPU,
    another XLA) could shift the whole random stream; rounded means give the
    same draws unless a mean straddles a rounding boundary (odds ~1e-7 each).
    """
    with np.errstate(divide="ignore"):
        exponent = np.floor(np.log10(np.abs(x)))
    exponent = np.where(np.isfinite(exponent), exponent, 0.0)
    scale = 10.0 ** (exponent - digits + 1)
    return np.round(x / scale) * scale


# -- the dataset --------------------------------------------------------------------
def _assemble(spec, n_days, truth: _Truth, observed) -> xr.Dataset:
    """The dataset: observations with and without noise, covariates,
    `population` (unless the model has its own), initial-state variables."""
    covariates, initial, expected = truth.covariates, truth.initial, truth.expected
    population = truth.population
    n = next(iter(expected.values())).shape[1]
    width = len(str(n - 1))
    labels = np.asarray([f"p{i:0{width}d}" for i in range(n)], dtype=str)
    time = (START + np.arange(n_days)).astype("datetime64[ns]")
    coords: dict[str, Any] = {
        TIME: (TIME, time, {"long_name": "date", "standard_name": "time"}),
        PATCH: (PATCH, labels, {"long_name": "patch label"}),
    }
    dims = {c.name: c.dims for c in spec.covariates}
    if any(PATCH_TO in d for d in dims.values()):
        coords[PATCH_TO] = (PATCH_TO, labels, {"long_name": "source patch label"})
    about = {c.name: c.kind for c in spec.observations}
    data: dict[str, Any] = {}
    for name, y in observed.items():
        what = "new" if about[name] == "incidence" else "current"
        data[name] = (
            (TIME, PATCH),
            y,
            {"long_name": f"observed {name} ({what} counts, with noise)", "units": "1"},
        )
        data[f"true_{name}"] = (
            (TIME, PATCH),
            expected[name],
            {"long_name": f"expected {name}: the noise-free model", "units": "1"},
        )
    long_names = {
        TIME + PATCH + PATCH_TO: "coupling weight: infectious in patch_to acting on "
        "patch (day-major, time-varying)",
        PATCH + PATCH_TO: "coupling weight: infectious in patch_to acting on patch",
        TIME + PATCH + FEATURE: "mobility index in [0, 1] (day-major)",
    }
    for name, value in covariates.items():
        if name == POPULATION:
            continue
        data[name] = (
            dims[name],
            value,
            {"long_name": long_names["".join(dims[name])], "units": "1"},
        )
    if population is not None:
        data[POPULATION] = (
            (PATCH,),
            population.astype(np.int64),
            {"long_name": "population size", "units": "1"},
        )
    for c in spec.initial:
        if c.data is None:
            continue
        v = initial[c.data]
        where = (PATCH,) if v.ndim == 1 else (f"{STAGE}_{c.compartment}", PATCH)
        if v.ndim == 2:
            coords[where[0]] = (where[0], np.arange(1, v.shape[0] + 1))
        data[c.data] = (
            where,
            v,
            {"long_name": f"initial state of compartment {c.compartment}"},
        )
    return xr.Dataset(data, coords=coords)


def _comment(counts_model: bool, noise: str) -> str:
    scale = (
        "The model is in counts: the expected count is its prediction."
        if counts_model
        else "The model is in fractions of each patch: the expected count is "
        "population * prediction, so a fit must scale the model's prediction by "
        "'population' the same way; the initial-state variables are fractions."
    )
    return (
        f"Observations are counts with {noise} noise around true_<name> (NaN on day "
        f"0 for incidence). {scale} true_parameters holds the constrained true "
        "values (MLP weights as nested lists, weight (out, in), bias (out,)). "
        "Generated by epifit.simulation.synthetic_metapopulation."
    )


def _model_text(spec: ModelSpec) -> str:
    if spec.path is not None and Path(spec.path).is_file():
        return Path(spec.path).read_text()
    return ""
