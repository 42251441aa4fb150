"""The synthetic generator's covariates: coupling and mobility, drawn.

Patches sit at points of the unit square; coupling is a sparse k-nearest-
neighbour gravity matrix with a slow modulation (a lockdown, a partial
reopening, a weekly rhythm, a drift per patch); mobility features are smooth
in `[0, 1]` with a lockdown dip. See `synthetic_metapopulation`.
"""

from __future__ import annotations

import numpy as np

from epifit._schema import FEATURE, PATCH, PATCH_TO, POPULATION, TIME
from epifit.model import ModelSpec

__all__ = ["draw_covariates"]


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


def draw_covariates(
    spec: ModelSpec, rng, xy, population, n_days
) -> dict[str, np.ndarray]:
    """Day-major covariates for every covariate the model declares, drawn from
    `rng` in the order of the model's covariates."""
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
