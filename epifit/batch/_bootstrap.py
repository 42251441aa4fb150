"""Bootstrap replicates of a task: data drawn from its fit, and percentile
intervals over the refits.

A replicate task reads its original task's `FIT.nc`, draws a dataset from the
fit (`bootstrap_data`), refits it from the original's estimate, and writes
its own files like any task; the merge gives each original task the
percentile intervals of its replicates' estimates (`bootstrap_intervals`).

Cost: one forward solve of the model at the fit (the noise: one draw per
observed point), then the refit, which dominates.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from typing import Any

import numpy as np
from jaxtyping import Bool, Float, Int

__all__ = ["bootstrap_data", "bootstrap_intervals", "replicate_seed"]


def replicate_seed(seed: int, key: str, replicate: int) -> int:
    """The noise seed of replicate `replicate` of task `key` in a batch whose
    `bootstrap.seed` is `seed`: the first 4 bytes (big-endian) of the SHA-256
    of the JSON text `[seed, key, replicate]`, so that it does not depend on
    the order the tasks run in, and a task's replicates differ.

    Examples:
        >>> replicate_seed(0, "task-0123456789ab", 0) == replicate_seed(
        ...     0, "task-0123456789ab", 0
        ... )
        True
    """
    text = json.dumps([int(seed), str(key), int(replicate)])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big")


def bootstrap_data(fit, data, *, kind: str = "parametric", seed: int = 0):
    """A dataset drawn from a fit, for a bootstrap refit.

    The model (with the fit configuration's overrides, `fit.model`) is solved
    at the fitted parameters with the fit's solver settings, and every
    observation is drawn at the points the data observed (NaN where the data
    have none):

    - `parametric`: from its own noise family at the fitted values, as
      [`simulate`][epifit.simulation.simulate]`(observe="model", seed=seed)` draws it
      (a least-squares observation as a gaussian of `sd = sqrt(1 / (2 w))`);
    - `residual`: the prediction plus residuals (data minus prediction) of
      the same observation drawn with replacement
      (`numpy.random.default_rng(seed)`, in the order of the observations),
      clipped at 0.

    Args:
        fit: a `FitResult` bound to `data` (`FitResult.from_netcdf(path,
            data=data)`, or `calibrate`'s).
        data: the dataset the fit was fitted to (a Dataset or a path).
        kind: `parametric` or `residual`.
        seed: the seed of the draws (see `replicate_seed`).

    Returns:
        A Dataset with the observations under their own names and the
        covariates and initial-state variables the model reads, on the
        simulation's dated daily axis: data for `calibrate`.
    """
    from epifit.forecasting import solver_settings
    from epifit.simulation import simulate

    if fit.problem is None:
        raise ValueError("bootstrap_data needs a fit bound to its data (data=).")
    sim = simulate(
        fit.model,
        data,
        params=fit.params,
        settings=solver_settings(fit.settings, None, None, None, None, None),
        observe="model",
        seed=seed,
    )
    spec = fit.problem.spec
    rng = np.random.default_rng(seed)
    series = {}
    for obs in spec.observations:
        observed = sim[f"observed_{obs.name}"].values
        seen = np.isfinite(observed)
        if kind == "parametric":
            drawn = sim[obs.name].values
        elif kind == "residual":
            predicted = sim[f"predicted_{obs.name}"].values
            residuals = (observed - predicted)[seen]
            drawn = np.maximum(
                predicted + rng.choice(residuals, size=predicted.shape), 0.0
            )
        else:
            raise ValueError(f"unknown bootstrap kind {kind!r}")
        series[obs.name] = sim[obs.name].copy(data=np.where(seen, drawn, np.nan))
    inputs = [c.name for c in spec.covariates]
    inputs += [i.data for i in spec.initial if i.data is not None]
    out = sim[list(dict.fromkeys(inputs))].assign(series)
    out.attrs = {
        "title": f"bootstrap replicate ({kind}) of a fit of model '{spec.name}'",
        "bootstrap_kind": kind,
        "bootstrap_seed": int(seed),
        "parameters": sim.attrs.get("parameters", ""),
    }
    if kind == "parametric":
        out.attrs["observation_noise"] = sim.attrs.get("observation_noise", "")
    return out


def bootstrap_intervals(
    estimates: Float[np.ndarray, "task parameter"],
    original: Int[np.ndarray, " task"],
    replicate: Int[np.ndarray, " task"],
    ok: Bool[np.ndarray, " task"],
    level: float,
) -> tuple[Any, Any, Any]:
    """Percentile intervals of each original task's replicates.

    For each original task `i` (`replicate[i] == -1`), the `(1 - level) / 2`
    and `(1 + level) / 2` percentiles (NumPy's `linear` method, NaNs left
    out) of `estimates` over the `ok` tasks with `original == i` and
    `replicate >= 0`; NaN for replicates and for originals with no ok
    replicate.

    Returns:
        `(lower, upper)`, each `(task, parameter)`, and `n (task,)`: the ok
        replicates each interval comes from (0 for replicates).
    """
    estimates = np.asarray(estimates, np.float64)
    lower = np.full(estimates.shape, np.nan)
    upper = np.full(estimates.shape, np.nan)
    n = np.zeros(estimates.shape[0], np.int64)
    q = [100 * (1 - level) / 2, 100 * (1 + level) / 2]
    for i in np.flatnonzero(np.asarray(replicate) < 0):
        rows = (np.asarray(original) == i) & (np.asarray(replicate) >= 0) & ok
        n[i] = int(rows.sum())
        if n[i] == 0:
            continue
        with warnings.catch_warnings():  # a parameter without any estimate
            warnings.simplefilter("ignore", RuntimeWarning)
            lower[i], upper[i] = np.nanpercentile(estimates[rows], q, axis=0)
    return lower, upper, n
