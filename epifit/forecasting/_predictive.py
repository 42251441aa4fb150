"""Predictive bands: observation noise on each draw's expected observations.

A forecast's expected observed series (the model's prediction of each
`[[observations]]` entry: its delay, ascertainment, day-of-week effect and
period already applied) is what the data would be on average; the data
themselves scatter around it by the observation's family. With
`observation_noise=True` (the default) every draw's expected series gets
`replicates` draws of that noise (`epifit.simulation.sample_noise`, at the
draw's own dispersion or sd), so the quantiles are over draws x noise: the
band a new data point should fall in. The point estimate (`estimate_*`),
the compartments, `R_eff` and the derived series are not observed and stay
noise-free. A `least_squares` observation has no noise model: its band is
that of its mean, and its `bands` attribute says so.

Seeds: observation `i`'s noise is drawn by NumPy's generator seeded with
`(seed, i, NOISE_STREAM)` (the forecast's `seed`), the same stream in every
scenario (common random numbers: scenario differences are not blurred by
the noise), apart from the stream `epifit simulate --observe --seed` draws
data from. NumPy, not `jax.random`: `jax.random.poisson` compiles a
rejection sampler for every new shape of series (about 2 s each).

Cost: one vmapped evaluation of the noise parameters over the draws, then
per scenario and noisy series `replicates x draws x days x patches` draws
on the host, `replicates = ceil(NOISE_SAMPLES / draws)` (at least
`NOISE_SAMPLES` noisy samples per series, so a forecast of few draws, or
of the point estimate alone, still has a band).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
import numpy as np
import xarray as xr
from jax.flatten_util import ravel_pytree

from epifit.simulation import sample_noise

__all__ = ["NOISE_SAMPLES", "NoisePlan", "label_bands", "noise_plan"]

NOISE_SAMPLES = 400
"""The fewest noisy samples a noisy series' quantiles are taken over: the
central 95% interval of `n` samples (linear interpolation of the order
statistics) holds a new continuous draw with probability
`0.95 (n - 1) / (n + 1)` (94.5% at 400)."""

NOISE_STREAM = 0x0B5E
"""Folded into the observation keys: the forecast's stream, not simulate's."""

FAMILY_NAMES = {
    "poisson": "Poisson",
    "negative_binomial": "negative binomial",
    "gaussian": "Gaussian",
}


@dataclasses.dataclass(frozen=True)
class NoisePlan:
    """Which observed series get which noise.

    Attributes:
        enabled: `observation_noise` as asked.
        families: per observed series, the family its noise is drawn from,
            or `None` (noise off, or a `least_squares` observation).
        reasons: per observed series without noise, why (for the `bands`
            attribute).
    """

    enabled: bool
    families: Mapping[str, str | None]
    reasons: Mapping[str, str]

    @property
    def noisy(self) -> tuple[str, ...]:
        return tuple(n for n, f in self.families.items() if f is not None)

    def replicates(self, draws: int) -> int:
        """Noise draws per parameter draw, for `draws` draws (0: none)."""
        return math.ceil(NOISE_SAMPLES / draws) if draws and self.noisy else 1

    def attrs(self) -> dict[str, Any]:
        """The Dataset attributes: the family per observed series (`"none"`
        without noise)."""
        return {
            "observation_noise": json.dumps(
                {n: f or "none" for n, f in self.families.items()}
            ),
            "observation_noise_enabled": int(self.enabled),
        }

    def bands(self, series: Mapping[str, str], samples: int) -> dict[str, str]:
        """What the quantiles of each series are over: `series` maps a name
        to its kind (`observed`, else not observed)."""
        draws = f"{samples} parameter draws" if samples else "the point estimate"
        out = {}
        for name, kind in series.items():
            family = self.families.get(name) if kind == "observed" else None
            if family is not None:
                out[name] = f"{draws} and {FAMILY_NAMES[family]} observation noise"
            elif kind == "observed":
                out[name] = f"{draws} only ({self.reasons[name]})"
            else:
                out[name] = f"{draws} only (not observed: no observation noise)"
        return out

    def parameters(self, cfg, xs: np.ndarray, template) -> dict[str, dict]:
        """Per noisy series, its family's parameter at every row of `xs`:
        `{name: {"dispersion" | "sd": (row, ...)}}` (`{}` for a poisson)."""
        wanted = {
            o.name: o for o in cfg.model.spec.observations if o.name in self.noisy
        }
        if not any(self.families[n] != "poisson" for n in wanted):
            return {n: {} for n in wanted}
        fn = _parameter_fn(cfg, tuple(sorted(wanted)))
        out = fn(jax.numpy.asarray(xs, cfg.dtype), template)
        return {n: {k: np.asarray(v) for k, v in d.items()} for n, d in out.items()}

    def add_noise(
        self,
        chosen: dict[str, np.ndarray],
        parameters: Mapping[str, Mapping[str, np.ndarray]],
        *,
        seed: int,
        index: Mapping[str, int],
    ) -> dict[str, np.ndarray]:
        """`chosen` (`{series: (draw, time, patch...)}`) with each noisy
        series replaced by `replicates` noisy copies of every draw
        `(replicates x draw, ...)` (replicate-major); `parameters` per draw
        as `chosen` (see `parameters`); `index` the observation's place in
        the model (its seed stream). NaN (no value that day) stays NaN."""
        out = dict(chosen)
        for name in self.noisy:
            mean = np.asarray(chosen[name], np.float64)
            k = mean.shape[0]
            if k == 0:
                continue
            r = self.replicates(k)
            kw = {p: _per_draw(v, r) for p, v in parameters[name].items()}
            missing = np.tile(np.isnan(mean), (r, 1, 1))
            mean = np.where(missing, 0.0, np.tile(mean, (r, 1, 1)))
            rng = np.random.default_rng([seed, index[name], NOISE_STREAM])
            drawn = sample_noise(rng, self.families[name], mean, **kw)
            out[name] = np.where(missing, np.nan, drawn)
        return out


def _per_draw(v: np.ndarray, r: int) -> np.ndarray:
    """A parameter per draw, `(draw,)` or `(draw, patch)`, as `(r x draw, 1,
    1 or patch)`: it broadcasts against `(r x draw, time, patch)` series."""
    v = np.asarray(v, np.float64)
    v = v.reshape(v.shape[0], 1, -1 if v.ndim > 1 else 1)
    return np.tile(v, (r, 1, 1))


def noise_plan(model, enabled: bool) -> NoisePlan:
    """The noise of every observation of `model` (`observation_noise=enabled`).

    Raises:
        TypeError: `enabled` is not a bool (naming `observation_noise`).
    """
    if not isinstance(enabled, bool | np.bool_):
        raise TypeError(f"observation_noise must be True or False; got {enabled!r}")
    families, reasons = {}, {}
    for obs in model.spec.observations:
        if not enabled:
            families[obs.name] = None
            reasons[obs.name] = "observation noise off: the expected observations"
        elif obs.family == "least_squares":
            families[obs.name] = None
            reasons[obs.name] = (
                "least_squares has no noise model: the expected observations"
            )
        else:
            families[obs.name] = obs.family
    return NoisePlan(bool(enabled), families, reasons)


@functools.lru_cache(maxsize=8)
def _parameter_fn(cfg, names: tuple[str, ...]):
    """`(xs, template) -> {name: {param: (row, ...)}}`, compiled, vmapped."""
    specs = {o.name: o for o in cfg.model.spec.observations}

    def one(x, template):
        free, rest = template
        _, unravel = ravel_pytree(free)
        params = eqx.combine(unravel(x), rest, cfg.static.tree)
        values = cfg.model.constrain(params)
        out = {}
        for name in names:
            obs = specs[name]
            if obs.family == "negative_binomial":
                out[name] = {"dispersion": values[obs.dispersion]}
            elif obs.family == "gaussian":
                out[name] = {"sd": obs.sd.evaluate(values)}
            else:
                out[name] = {}
        return out

    return jax.jit(jax.vmap(one, in_axes=(0, None)))


def label_bands(ds: xr.Dataset, bands: Mapping[str, str]) -> xr.Dataset:
    """Write each series' band description into the `bands` attribute of its
    quantile variables (`s`, `s_total`, its statistics)."""
    for name, text in bands.items():
        stats = [f"{st}_{name}" for st in ("peak_day", "peak", "cumulative")]
        for var in (name, *stats):
            for v in (var, f"{var}_total"):
                if v in ds:
                    ds[v].attrs["bands"] = text
    return ds
