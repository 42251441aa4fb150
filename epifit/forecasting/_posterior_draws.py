"""Forecast draws from a posterior sample (`epifit sample`), in place of the
Laplace approximation's; and the fit a posterior embeds (its `fit` group), so
that a posterior alone can be forecast."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

from epifit._paths import file_sha256
from epifit._stored import note_input
from epifit.fitting import FIT_GROUP, FitResult

__all__ = ["is_posterior", "posterior_draws", "posterior_fit"]


def _file_groups(path: Path) -> set[str] | None:
    """The netCDF groups of a file at the root; None for a file netCDF cannot
    read (the reader it goes to reports it)."""
    import netCDF4

    try:
        with netCDF4.Dataset(path) as nc:
            return set(nc.groups)
    except (OSError, ValueError, RuntimeError):
        return None


def is_posterior(obj: Any) -> bool:
    """Whether `obj` is a posterior sample: a netCDF file with a `posterior`
    group (`epifit sample`'s `POSTERIOR.nc`; a `FIT.nc` has no groups), an
    ArviZ `InferenceData` or an `epifit.sampling.Posterior`."""
    if isinstance(obj, str | os.PathLike):
        path = Path(obj)
        return path.is_file() and "posterior" in (_file_groups(path) or ())
    data = getattr(obj, "data", obj)
    return isinstance(getattr(data, "posterior", None), xr.Dataset)


def _no_fit(where: str) -> ValueError:
    return ValueError(
        f"{where} holds no fit (a posterior written before posterior files "
        "embedded their fit): forecast it with its fit, `epifit forecast FIT.nc "
        f"--posterior {where}` (forecast(fit, posterior=...))"
    )


def posterior_fit(
    posterior: Any, data: xr.Dataset | str | os.PathLike | None
) -> tuple[FitResult, dict[str, Any]]:
    """The MAP fit a posterior embeds (its `fit` group, as `FIT.nc` holds
    it), bound to `data` when given, else to the data file it names (found
    by its SHA-256: absolute path, then relative to the posterior file's
    folder, then to the working directory); and the forecast's provenance
    attributes saying where the fit came from.

    Raises:
        ValueError: a posterior without an embedded fit (written before
            posterior files held one).
    """
    if isinstance(posterior, str | os.PathLike):
        path = Path(posterior)
        if FIT_GROUP not in (_file_groups(path) or ()):
            raise _no_fit(str(path))
        fit = FitResult.from_netcdf(path, data=data, group=FIT_GROUP)
        return fit, {"fit_file": str(path), "fit_group": FIT_GROUP}
    own = getattr(posterior, "fit", None)  # an epifit Posterior's
    if isinstance(own, FitResult) and data is None:
        return own, {"fit_group": FIT_GROUP}
    idata = getattr(posterior, "data", posterior)
    group = getattr(idata, FIT_GROUP, None)
    if not isinstance(group, xr.Dataset):
        raise _no_fit("the posterior")
    return FitResult.from_dataset(group, data=data), {"fit_group": FIT_GROUP}


def _posterior_group(posterior: Any) -> tuple[xr.Dataset, str]:
    """The `posterior` group of a `POSTERIOR.nc` path, an ArviZ
    `InferenceData` or an `epifit.sampling.Posterior`, and where it came from."""
    if isinstance(posterior, str | os.PathLike):
        path = Path(posterior)
        if not path.is_file():
            raise FileNotFoundError(f"Posterior file {path} does not exist.")
        try:
            note_input(path)
            group = xr.open_dataset(path, group="posterior").load()
        except (OSError, ValueError, KeyError) as err:
            raise ValueError(
                f"{path}: not a posterior file of epifit sample (no readable "
                f"'posterior' group: {err})"
            ) from None
        return group, str(path)
    data = getattr(posterior, "data", posterior)  # a Posterior, or InferenceData
    group = getattr(data, "posterior", None)
    if not isinstance(group, xr.Dataset):
        raise TypeError(
            "posterior must be a POSTERIOR.nc path, an epifit Posterior or an "
            f"arviz InferenceData; got {type(posterior).__name__}"
        )
    return group, ""


def posterior_draws(
    posterior: Any,
    labels: tuple[str, ...],
    samples: int,
    seed: int,
    x_hat: np.ndarray | None = None,
) -> tuple[np.ndarray, dict[str, Any]]:
    """`samples` of the posterior's draws of the free vector, `(samples,
    free)` (chosen without replacement, by `seed`, among all chains' draws),
    and the provenance attributes of the forecast.

    A posterior over some of the fit's free parameters (sampled with the
    others fixed at the fit's values, `x_hat`: a conditional posterior)
    gives draws with those others at `x_hat`.

    Raises:
        ValueError: a file that is not a posterior, free parameters that are
            not the fit's (naming the first that differs), or more samples
            than the posterior has draws.
    """
    group, source = _posterior_group(posterior)
    where = source or "posterior"
    if "x" not in group or "free" not in group["x"].dims:
        raise ValueError(
            f"{where}: no free vector 'x' (chain, draw, free) to draw from"
        )
    theirs = tuple(str(v) for v in group["free"].values)
    cols = _columns(theirs, labels, x_hat)
    if cols is None:
        diff = next(
            (i for i, (a, b) in enumerate(zip(theirs, labels, strict=False)) if a != b),
            min(len(theirs), len(labels)),
        )
        raise ValueError(
            f"{where}: its free parameters are not the fit's ({len(theirs)} vs "
            f"{len(labels)}; first difference at entry {diff}: "
            f"{theirs[diff] if diff < len(theirs) else '-'!r} vs "
            f"{labels[diff] if diff < len(labels) else '-'!r})"
        )
    x = np.asarray(group["x"].transpose("chain", "draw", "free").values, np.float64)
    flat = x.reshape(-1, x.shape[-1])
    if samples > flat.shape[0]:
        raise ValueError(
            f"samples = {samples} but {where} holds {flat.shape[0]} draws; give "
            "at most that many"
        )
    pick = np.sort(np.random.default_rng(seed).choice(flat.shape[0], samples, False))
    attrs = {"draws_from": "posterior", "posterior_draws": int(flat.shape[0])}
    if len(cols) < len(labels):  # the rest at the fit's values
        full = np.tile(np.asarray(x_hat, np.float64), (samples, 1))
        full[:, cols] = flat[pick]
        attrs["posterior_fixed_at_fit"] = len(labels) - len(cols)
        return full, attrs | _source_attrs(source)
    return flat[pick], attrs | _source_attrs(source)


def _source_attrs(source: str) -> dict[str, Any]:
    if not source:
        return {}
    return {"posterior_file": source, "posterior_sha256": file_sha256(source)}


def _columns(theirs, labels, x_hat) -> list[int] | None:
    """Where each of the posterior's free labels sits among the fit's: all
    of them in order, or (given the fit's values `x_hat`) a subset of them,
    each once; None otherwise."""
    if theirs == tuple(labels):
        return list(range(len(labels)))
    where = {label: i for i, label in enumerate(labels)}
    if x_hat is None or len(set(theirs)) != len(theirs):
        return None
    if not theirs or any(t not in where for t in theirs):
        return None
    return [where[t] for t in theirs]
