"""The sampler's output as ArviZ data, and its convergence summary."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import xarray as xr

from epifit._jit import jit
from epifit._paths import file_sha256
from epifit.fitting import FIT_GROUP, FitResult, library_versions, observation_model
from epifit.sampling._nuts import STATS, NutsSettings
from epifit.simulation import sample_noise

__all__ = ["FIT_GROUP", "Posterior", "posterior_data"]

# the posterior predictive's noise: NumPy's generator seeded with (seed, this,
# the observation's index), a stream of its own
PREDICTIVE_STREAM = 0x9D1C7

RHAT_MAX = 1.01
ESS_MIN = 400
# FIT_GROUP (epifit.fitting): the InferenceData group holding the MAP fit the
# chains started from, as `FitResult.to_dataset` makes it (not one of ArviZ's
# schema groups: ArviZ reads, writes and carries it along, asked by name only)


def _values_fn(density):
    """`x -> (constrained values, predictions, pointwise log-likelihood,
    observation-noise parameters)` for one draw, compiled and vmapped."""
    obj = density.objective
    neural = {n.name for n in obj.problem.spec.neural}
    # the free parameters and the derived quantities (a fixed value is in the
    # model text, and has no R-hat)
    wanted = set(obj.free.names) | {d.name for d in obj.problem.spec.derived}

    def one(x, data):
        params, _, pred = obj.predictions(x, data)
        values = obj.problem.model.constrain(params)
        arrays = data["arrays"]
        ll, noise = {}, {}
        for o in obj.observations:
            m = arrays["mask"][o.name]
            point = observation_model(o, values).point_log_likelihood(
                pred[o.name], arrays["observed"][o.name], m
            )
            ll[o.name] = jnp.where(m, point, jnp.nan)
            if o.family == "negative_binomial":
                noise[o.name] = {"dispersion": values[o.dispersion]}
            elif o.family == "gaussian":
                noise[o.name] = {"sd": o.sd.evaluate(values)}
        kept = {k: v for k, v in values.items() if k in wanted and k not in neural}
        return kept, {o.name: pred[o.name] for o in obj.observations}, ll, noise

    # evaluated once a chain: for a small model (`Objective.forward_pays`)
    # compiled for that (LLVM at level 0); boarding-school SIR, 4 x 1000
    # draws, `posterior_data` 1.46 s, twice, against 1.72-1.96 s (`jax.jit`)
    # and 1.98-2.25 s (`epifit.jit` at the default level), one process each
    return jit(jax.vmap(one, in_axes=(0, None)), once=obj.forward_pays)


def _dims(name: str, shape: tuple, patches) -> tuple[list[str], dict]:
    if not shape:
        return [], {}
    if len(shape) == 1 and shape[0] == len(patches) and len(patches) > 1:
        return ["patch"], {"patch": list(patches)}
    return [f"{name}_dim_{i}" for i in range(len(shape))], {}


def _series_dims(problem, shape: tuple) -> tuple[list[str], dict]:
    """An observation's `(time, patch...)` dims."""
    coords = {"time": problem.dataset["time"].values[: shape[0]]}
    dims = ["time"]
    if len(shape) > 1:
        dims.append("patch")
        coords["patch"] = list(problem.patches)[: shape[1]]
    for i in range(2, len(shape)):
        dims.append(f"dim_{i}")
    return dims, coords


def posterior_data(
    density,
    data,
    results,
    settings: NutsSettings,
    *,
    x_map,
    provenance,
    timing,
    fit: FitResult | None = None,
):
    """The chains' draws as an `arviz.InferenceData`: `posterior` (every
    parameter's constrained value, derived quantities, and the free vector
    `x` with its labels), `sample_stats`, `log_likelihood` (per observed
    point), `posterior_predictive` (with each family's observation noise),
    `observed_data`, `constant_data` (the data's other variables) and `fit`
    (the MAP `fit` the chains started from, as `FIT.nc` holds it; see
    `embedded_fit`)."""
    import arviz as az

    obj = density.objective
    problem = obj.problem
    xs = np.stack([r["positions"] for r in results])  # (chain, draw, n)
    C, D, n = xs.shape
    fn = _values_fn(density)
    parts = [fn(jax.device_put(xs[c]), data) for c in range(C)]
    values, preds, lls, noise = (
        jax.tree.map(lambda *a: np.stack([np.asarray(v) for v in a]), *col)
        for col in zip(*parts, strict=True)
    )
    posterior = {}
    coords = {"free": list(obj.free.labels)}
    for name, v in values.items():
        dims, c = _dims(name, v.shape[2:], problem.patches)
        posterior[name] = (["chain", "draw", *dims], v)
        coords |= c
    posterior["x"] = (["chain", "draw", "free"], xs)
    stats = {
        # the names ArviZ's sample_stats group uses
        k: (["chain", "draw"], np.stack([r["stats"][k] for r in results]))
        for k in STATS
    }
    stats["step_size"] = (
        ["chain", "draw"],
        np.repeat(np.array([[r["step_size"]] for r in results]), D, axis=1),
    )
    loglik, predictive, observed = _observation_groups(
        obj, data, preds, lls, noise, settings.seed, coords
    )
    constant = _constant_data(problem, set(observed))
    attrs = {
        "created_by": "epifit.sample",
        "inference_library": "blackjax",
        "sampler": "nuts",
        "chains": C,
        "draws": D,
        "warmup": settings.warmup,
        "mass_matrix": settings.mass_matrix,
        "target_accept": settings.target_accept,
        "max_tree_depth": settings.max_tree_depth,
        "seed": settings.seed,
        "model_name": problem.spec.name,
        "map_x": json.dumps([float(v) for v in np.ravel(x_map)]),
        "versions": json.dumps(library_versions()),
        "timing": json.dumps(timing),
        **{k: str(v) for k, v in provenance.items()},
    }
    draw_coords = {"chain": np.arange(C), "draw": np.arange(D)}
    groups = {
        "posterior": (posterior, coords),
        "sample_stats": (stats, {}),
        "log_likelihood": (loglik, coords),
        "posterior_predictive": (predictive, coords),
    }
    datasets = {
        g: xr.Dataset(
            v, coords={**draw_coords, **{k: c[k] for k in c if _uses(v, k)}}
        ).assign_attrs(attrs)
        for g, (v, c) in groups.items()
    }
    datasets["observed_data"] = xr.Dataset(
        observed, coords={k: coords[k] for k in coords if _uses(observed, k)}
    ).assign_attrs(attrs)
    if constant is not None:
        datasets["constant_data"] = constant.assign_attrs(attrs)
    if fit is not None and fit.trajectories is not None:
        datasets[FIT_GROUP] = embedded_fit(fit)
    # `fit` is a group of epifit's own: said once here, not warned about
    return az.InferenceData(**datasets, warn_on_custom_groups=False)


def embedded_fit(fit: FitResult) -> xr.Dataset:
    """The `fit` group: `fit.to_dataset()` (what `FIT.nc` holds), naming the
    data file the fit is bound to, so that a forecast of the posterior file
    alone finds it again by its SHA-256 as `FitResult.from_netcdf` finds a
    fit's (its absolute path, then its path relative to the posterior file's
    folder, then to the working directory). A fit bound to other data than
    it names (`from_netcdf(..., data=...)`) names the data it is bound to,
    or none for data in memory (a forecast then needs `data=`)."""
    ds = fit.to_dataset()
    problem = fit.problem
    if problem is None:
        return ds
    sha = file_sha256(problem.data_path) if problem.data_path else None
    if sha != ds.attrs.get("data_sha256"):
        given = str(problem.data_path or "")
        ds.attrs["data_file"] = given
        ds.attrs["data_file_absolute"] = str(Path(given).resolve()) if given else ""
        ds.attrs.pop("data_sha256", None)
        if sha:
            ds.attrs["data_sha256"] = sha
    return ds


def _observation_groups(obj, data, preds, lls, noise, seed: int, coords: dict):
    """`log_likelihood`, `posterior_predictive` (each family's noise around
    every draw's predictions; least_squares has none: the expected values)
    and `observed_data` (NaN where nothing is observed); adds the series'
    coordinates to `coords`."""
    loglik, predictive, observed = {}, {}, {}
    for i, o in enumerate(obj.observations):
        mean = preds[o.name]
        dims, c = _series_dims(obj.problem, mean.shape[2:])
        coords |= c
        loglik[o.name] = (["chain", "draw", *dims], lls[o.name])
        if o.family == "least_squares":
            drawn = mean
        else:
            kw = {k: _against(v, mean.ndim) for k, v in noise.get(o.name, {}).items()}
            missing = ~np.isfinite(mean)
            drawn = sample_noise(
                np.random.default_rng([seed, PREDICTIVE_STREAM, i]),
                o.family,
                np.where(missing, 0.0, mean),
                **kw,
            )
            drawn = np.where(missing, np.nan, np.asarray(drawn))
        predictive[o.name] = (["chain", "draw", *dims], drawn)
        obs = np.asarray(data["arrays"]["observed"][o.name], np.float64)
        mask = np.asarray(data["arrays"]["mask"][o.name], bool)
        observed[o.name] = (dims, np.where(mask, obs, np.nan))
    return loglik, predictive, observed


def _against(v: np.ndarray, ndim: int) -> np.ndarray:
    """A family parameter per draw, `(chain, draw)` or `(chain, draw,
    patch)`, shaped to broadcast against `(chain, draw, time, patch...)`."""
    v = np.asarray(v, np.float64)
    return v.reshape(v.shape[:2] + (1,) * (ndim - v.ndim) + v.shape[2:])


def _uses(variables: dict, dim: str) -> bool:
    return any(dim in dims for dims, _ in variables.values())


def _constant_data(problem, observed: set[str]) -> xr.Dataset | None:
    """The dataset's numeric variables other than the observations."""
    ds = problem.dataset
    if ds is None:
        return None
    keep = [
        v
        for v in ds.data_vars
        if v not in observed and np.issubdtype(ds[v].dtype, np.number)
    ]
    return ds[keep].load() if keep else None


class Posterior:
    """Posterior draws (`data`: an `arviz.InferenceData`) and the MAP fit the
    chains started from (`fit`).

    Args:
        data: the `InferenceData` (see [`sample`][epifit.sample]).
        fit: the fit the chains started from (default: the one the `fit`
            group of `data` holds, read when first asked for).
        source: the file `data` was read from (a data file the `fit` group
            names by a relative path is looked for in its folder first).
    """

    def __init__(
        self,
        data,
        fit: FitResult | None = None,
        source: str | os.PathLike | None = None,
    ):
        self.data = data
        self._fit = fit
        self.source = None if source is None else Path(source)

    @property
    def fit(self) -> FitResult | None:
        """The MAP fit the chains started from (its model, data, fit
        configuration and point estimate): the one `sample` ran from, else the
        one the `fit` group holds, bound to its data file when that is found
        (absolute path, relative to the posterior file's folder, then to the
        working directory); None for a posterior written without it (before
        posterior files embedded their fit)."""
        if self._fit is None and FIT_GROUP in self.data.groups():
            if self.source is not None:
                self._fit = FitResult.from_netcdf(self.source, group=FIT_GROUP)
            else:
                self._fit = FitResult.from_dataset(getattr(self.data, FIT_GROUP))
        return self._fit

    @property
    def parameters(self) -> list[str]:
        """The posterior's parameter variables (not the free vector `x`)."""
        return [v for v in self.data.posterior.data_vars if v != "x"]

    def diagnostics(self, round_to: int | str = "none"):
        """`arviz.summary` of the parameters: means, sd, HDI, MCSE, R-hat,
        bulk and tail ESS; unrounded unless `round_to` says (arviz's own
        default of two decimals would show an R-hat of 1.014 as 1.01)."""
        import arviz as az

        return az.summary(self.data, var_names=self.parameters, round_to=round_to)

    def warnings(self) -> list[str]:
        """What says the chains are not to be trusted yet: R-hat above 1.01,
        a bulk or tail ESS below 400, divergent transitions; and what says
        the posterior is badly conditioned: transitions that reached the
        maximum tree depth, a start at a saddle (`map_saddle`)."""
        table = self.diagnostics()
        out = []
        bad = table[table["r_hat"] > RHAT_MAX]
        if len(bad):
            out.append(
                f"R-hat above {RHAT_MAX} for {len(bad)} value(s), worst "
                f"{bad['r_hat'].idxmax()} ({bad['r_hat'].max():.3f}): run longer"
            )
        for col in ("ess_bulk", "ess_tail"):
            low = table[table[col] < ESS_MIN]
            if len(low):
                out.append(
                    f"{col} below {ESS_MIN} for {len(low)} value(s), lowest "
                    f"{low[col].idxmin()} ({low[col].min():.0f}): run longer"
                )
        div = int(np.asarray(self.data.sample_stats["diverging"]).sum())
        if div:
            out.append(
                f"{div} divergent transition(s): raise target_accept or reparameterise"
            )
        return out + _geometry_warnings(self.data)

    def summary(self) -> str:
        """The diagnostics table and the warnings, as text."""
        text = self.diagnostics(round_to=3).to_string()
        warns = self.warnings()
        lines = [text, ""]
        lines += [f"warning: {w}" for w in warns] or ["no warnings"]
        return "\n".join(lines)

    def to_netcdf(self, path: str | os.PathLike) -> Path:
        """Write the InferenceData to netCDF, atomically (a temporary file in
        the target's folder, renamed)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        os.close(fd)
        try:
            self.data.to_netcdf(tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return path

    @classmethod
    def from_netcdf(cls, path: str | os.PathLike) -> Posterior:
        """Read a `POSTERIOR.nc` (its fit, when it has one, when first asked
        for: see `fit`)."""
        import arviz as az

        return cls(az.from_netcdf(path), source=path)

    def __repr__(self) -> str:
        p = self.data.posterior
        return (
            f"Posterior({p.sizes['chain']} chains x {p.sizes['draw']} draws, "
            f"{len(self.parameters)} parameters)"
        )


def _geometry_warnings(idata) -> list[str]:
    """Transitions that reached the maximum tree depth (the step size far
    below the posterior's widest scales: each costs `2^depth` gradients), and
    a start at a saddle of the log posterior (`map_saddle`, set by `sample`)."""
    attrs = idata.posterior.attrs
    out = []
    if "max_tree_depth" in attrs and "tree_depth" in idata.sample_stats:
        depth = np.asarray(idata.sample_stats["tree_depth"])
        hits = int((depth >= int(attrs["max_tree_depth"])).sum())
        if hits:
            out.append(
                f"{hits} of {depth.size} transition(s) reached the maximum tree "
                f"depth {attrs['max_tree_depth']}: a badly conditioned posterior "
                "(reparameterise, fix what the data cannot identify, or use "
                "mass_matrix='dense')"
            )
    if str(attrs.get("map_saddle", "False")) == "True":
        out.append(
            "the MAP the chains started from has negative curvature (its fit's "
            "Laplace approximation fell back): a saddle, not a mode, so its "
            "covariance is a poor guide to the posterior's scales; fit longer, "
            "or sample a conditional posterior (a fit configuration that fixes "
            "a neural sub-model's weights, or its hidden layers: fixed = "
            '"hidden")'
        )
    return out
