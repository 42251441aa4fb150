"""Synthetic metapopulation datasets from known parameters (`synthetic_metapopulation`).

The generator follows the synthetic problem of the reference benchmark
(`shared/bench/seed_metapop.py`), written in epifit's conventions: patches at
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
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import xarray as xr

from epifit._schema import FEATURE, PATCH, PATCH_TO, POPULATION, STAGE, TIME
from epifit.model import CompiledModel, ModelSpec, as_model, parameters_json
from epifit.simulation._run import ModelRun
from epifit.simulation._settings import SolverSettings

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

    - **Patches** `p00, p01, ...` at uniform points of the unit square, with
      populations `round(1e5 * lognormal(0, 1))` (at least 1000): `population
      (patch)`.
    - **Coupling** covariates `(time, patch, patch_to)`: gravity weights
      `population[q] * exp(-distance / 0.1)` to the 10 nearest neighbours,
      normalised to row sums `U(0.05, 0.3)`, times a slow modulation (a
      lockdown factor 1 -> 0.5 around day 22, partial reopening around day 70,
      a weekly +-10 % rhythm, +-20 % drift per patch). A `(patch, patch_to)`
      covariate gets the unmodulated weights.
    - **Mobility** covariates `(time, patch, feature)`: features in `[0, 1]`,
      smooth in time, dipping around day 20 and recovering after day 70.
    - **True parameters**: the model file's values for scalar parameters; a
      per-patch parameter with no upper bound is spread as
      `lower + (value - lower) * U(0.7, 1.3)`. Each neural sub-model gets
      random weights (sd `1/sqrt(in_size)`, biases sd 0.1), its output
      layer then sign-fixed so the rate rises with mean mobility and affinely
      set so the 2nd-98th percentiles of the rate over all days and patches
      are 0.22-0.55 /day. `params` overrides any of these.
    - **Initial state**: the `[initial]` variables read from data, e.g.
      `initial_S (patch)`, `initial_ID (stage_ID, patch)` (each box-car chain
      has its own stage dim, `stage_<compartment>`, since chains differ in
      length). 5 % of the patches (at least 2) are seeded with
      `U(2e-4, 1e-3)` of their population in the infected compartment of the
      first infection; the rest is susceptible.
    - **Observations**: the model is solved with `Tsit5` at `rtol = 1e-10`,
      `atol = 1e-13` in float64; each observed series (with its ascertainment)
      is stored noise-free as `true_<name>` and with noise as `<name>`.
      Incidence has no value on day 0 (NaN).

    **Units.** Observations are counts. A model in fractions of each patch
    (no infection normalised by a population, as the reference
    `seird_metapop_mobility.toml`) is scaled: the expected count is `population
    * prediction`, so a fit must scale the model's prediction by `population`
    the same way (the dataset attribute `observation_scale` says
    `population`). A model in counts is used as it is (`observation_scale =
    "none"`); its initial state is `population` times the fractions above,
    and `population` is left out when the model reads neither it nor initial
    data (it has its own, a parameter such as `N`).

    **Noise** on the expected counts `mu`: `poisson`; `negative_binomial` with
    `dispersion` phi (variance `mu + mu^2 / phi`, default 10); `gaussian` with
    standard deviation `dispersion * mean(mu)` per series (default 0.1), the
    result clipped at 0; `none` (the truth clipped at 0). The noise is drawn
    independently of the model's declared likelihood family.

    Args:
        model: a TOML path, a `ModelSpec` or a `CompiledModel`.
        n_patches: the number of patches (>= 1).
        n_days: the number of days (>= 2).
        seed: seeds `numpy.random.default_rng`.
        noise: the observation noise.
        dispersion: the noise's dispersion (see above); only for
            `negative_binomial` and `gaussian`.
        params: constrained true values overriding the drawn ones, by name
            (an `eqx.nn.MLP` for a neural sub-model, a list for a per-patch
            parameter).

    Returns:
        `(dataset, true_params)`: the dataset (observations, `true_<name>`,
        covariates, `population`, initial-state variables; attributes
        `true_parameters` and `true_derived` as JSON of the constrained values,
        MLPs as `{"layers": [{"weight": [[...]], "bias": [...]}, ...]}`) and
        the true parameter pytree in unconstrained coordinates, as from
        `model.init_params` (`model.constrain(true_params)` gives the values).

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
    spec = compiled.spec
    _check_arguments(n_patches, n_days, seed, noise, dispersion)
    if dispersion is None:
        dispersion = DEFAULT_DISPERSION.get(noise)
    rng = np.random.default_rng(seed)
    with jax.enable_x64(True):
        xy = rng.uniform(0.0, 1.0, size=(n_patches, 2))
        population = np.maximum(
            np.round(1e5 * rng.lognormal(0.0, 1.0, size=n_patches)), 1000.0
        )
        covariates = _covariates(spec, rng, xy, population, n_days)
        values = _true_values(compiled, rng, n_patches, covariates, params)
        true_params = compiled.unconstrain(values)
        counts_model = any(i.normalize == "population" for i in spec.infections)
        initial = _initial_data(
            spec, rng, n_patches, population if counts_model else None
        )
        expected = _solve(compiled, true_params, covariates, initial, n_patches, n_days)
        scale = np.ones(n_patches) if counts_model else population
        expected = {k: v * scale[None, :] for k, v in expected.items()}
        observed = {
            k: _add_noise(rng, v, noise, dispersion) for k, v in expected.items()
        }
        constrained = compiled.constrain(true_params)
    if counts_model and not initial and POPULATION not in covariates:
        population = None  # the model has its own; a drawn one would mislead
    ds = _assemble(spec, n_days, covariates, population, initial, observed, expected)
    as_json = parameters_json(spec, constrained)
    ds.attrs.update(
        {
            "title": f"Synthetic metapopulation epidemic, model '{spec.name}', "
            f"{n_patches} patches, {n_days} days",
            "source": "epifit.simulation.synthetic_metapopulation",
            "comment": _comment(counts_model, noise),
            "Conventions": "CF-1.8",
            "model": spec.name,
            "model_text": _model_text(spec),
            "seed": int(seed),
            "noise": noise,
            "dispersion": "none" if dispersion is None else float(dispersion),
            "observation_units": "counts",
            "observation_scale": "none" if counts_model else POPULATION,
            "true_parameters": as_json["parameters"],
            "true_derived": as_json["derived_parameters"],
        }
    )
    return ds, true_params


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


# -- covariates ---------------------------------------------------------------------
def _smooth(rng, lead: tuple[int, ...], n_days: int, n_modes: int = 3) -> np.ndarray:
    """A few low-frequency sinusoids, `lead + (time,)`, roughly in [-1, 1]."""
    t = np.arange(n_days, dtype=np.float64)
    out = np.zeros(lead + (n_days,))
    for _ in range(n_modes):
        period = rng.uniform(20.0, 120.0, size=lead)
        phase = rng.uniform(0.0, 2 * np.pi, size=lead)
        amp = rng.uniform(0.3, 1.0, size=lead) / n_modes
        out += amp[..., None] * np.sin(
            2 * np.pi * t / period[..., None] + phase[..., None]
        )
    return out


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _gravity(rng, xy: np.ndarray, population: np.ndarray) -> np.ndarray:
    """Static coupling `(patch, patch_to)`: k-NN gravity, row sums U(0.05, 0.3)."""
    n = xy.shape[0]
    dist = np.sqrt(((xy[:, None, :] - xy[None, :, :]) ** 2).sum(-1))
    k = min(10, n - 1)
    weights = np.zeros((n, n))
    if k > 0:
        nearest = np.argsort(dist, axis=1, kind="stable")[:, 1 : k + 1]  # not self
        rows = np.repeat(np.arange(n), k)
        cols = nearest.reshape(-1)
        weights[rows, cols] = population[cols] * np.exp(-dist[rows, cols] / 0.1)
        weights /= weights.sum(axis=1, keepdims=True)
    return weights * rng.uniform(0.05, 0.3, size=n)[:, None]


def _covariates(spec: ModelSpec, rng, xy, population, n_days) -> dict[str, np.ndarray]:
    """Day-major covariates for every covariate the model declares."""
    n = xy.shape[0]
    t = np.arange(n_days, dtype=np.float64)
    in_sizes = {m.covariate: m.in_size - int(m.time_input) for m in spec.neural}
    static = _gravity(rng, xy, population)
    out: dict[str, np.ndarray] = {}
    for c in spec.covariates:
        if c.dims == (TIME, PATCH, PATCH_TO):
            lockdown = 1.0 - 0.5 * _sigmoid((t - 22.0) / 4.0)
            lockdown += 0.3 * _sigmoid((t - 70.0) / 6.0)
            weekly = 1.0 + 0.1 * np.sin(2 * np.pi * t / 7.0)
            drift = 1.0 + 0.2 * _smooth(rng, (n,), n_days)  # (patch, time)
            mod = (lockdown * weekly)[:, None] * drift.T  # (time, patch)
            out[c.name] = static[None, :, :] * mod[:, :, None]
        elif c.dims == (PATCH, PATCH_TO):
            out[c.name] = static
        elif c.dims == (TIME, PATCH, FEATURE):
            f = in_sizes[c.name]
            base = rng.uniform(0.3, 0.8, size=(n, f))
            sensitivity = rng.uniform(0.2, 0.6, size=(n, f))
            dip = _sigmoid((t - 20.0) / 4.0) - 0.6 * _sigmoid((t - 70.0) / 8.0)
            weekly = np.zeros(f)
            weekly[[i for i in (0, 1, 4) if i < f]] = 0.08  # retail, transit, work
            x = (
                base[:, :, None]
                - sensitivity[:, :, None] * dip
                + weekly[None, :, None] * np.sin(2 * np.pi * t / 7.0)
                + 0.08 * _smooth(rng, (n, f), n_days)
            )
            out[c.name] = np.clip(x, 0.0, 1.0).transpose(2, 0, 1)  # day-major
        elif c.dims == (PATCH,) and c.name == POPULATION:
            out[c.name] = population
        else:
            raise NotImplementedError(
                f"synthetic_metapopulation cannot invent covariate {c.name!r} with "
                f"dims {c.dims}; it makes (time, patch, patch_to), (patch, "
                "patch_to), (time, patch, feature) and 'population' (patch). "
                "Build the dataset yourself and simulate with epifit.simulate."
            )
        out[c.name] = np.ascontiguousarray(out[c.name], dtype=np.float64)
    return out


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
def _assemble(spec, n_days, covariates, population, initial, observed, expected):
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
