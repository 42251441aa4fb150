"""Case `metapop` of `sample.py`: NUTS on the 20-patch synthetic
metapopulation with its MLP (`models/seird_metapop_counts.toml` on
`data/synthetic_metapop_20.nc`, 199 free parameters).

The posterior: Poisson counts of daily new infections and deaths (the model's
fractions times each patch's population; day 0 is missing) and a prior on
every free parameter, on its constrained value: `kappa ~ LogNormal(0.5, 1)`,
`alpha ~ LogNormal(0.05, 1)`, `gamma ~ LogNormal(1, 1)` (median, sdlog),
each `scaler ~ LogNormal(1, 0.5)`, and every weight and bias of the MLP
`Normal(0, 3 / sqrt(7))` (epifit's default neural prior, declared here; every
layer has 7 inputs). The sampler moves on the unconstrained coordinates
(softplus), so the density gains `log sigmoid(x)` for each softplus
parameter. Solver tolerances `RTOL`, `ATOL` for every tool.

The peers' log density is written here by hand in the reference problem's
flat coordinates `p` (`reference/problem.py`: `kappa, alpha, gamma`,
`scaler[20]`, the MLP packed `W (out, in)` then `b` per layer), on its
vector field: `diffrax` is `reference.peers.build("diffrax-tsit5")`'s solve
(Tsit5, PID control, recursive checkpointing, the covariates traced
arguments, a failed solve a `-inf` density), `odeint` is
`jax.experimental.ode.odeint` (Dopri5, backsolve) with the covariates closed
over as constants. Like epifit's objective it drops the priors'
normalising constants and keeps the Poisson `log y!`, so both are the same
function: `tests/test_benchmarks.py` checks it at the MAP and at a random
point. `from_epifit(x, labels)` maps epifit's free vector onto `p` (a
permutation: no Jacobian).

The peers run numpyro's NUTS kernel (`numpyro.infer.hmc.hmc`, diagonal mass
matrix, the same Stan warm-up windows, target acceptance 0.8, tree depth
`--max-tree-depth`, as epifit's) from the MAP, one iteration per compiled
call (compiled ahead of time, so the compile is timed apart), with a JSON
line after the compile and after every iteration: a peer stopped at its cap
still reports the gradients it took and their cost. epifit samples with
`chunk = --block` and a checkpoint, which it writes after the warm-up and
every chunk; a thread turns each write into a line (`_watch`), so a stopped
epifit reports its draws too (its warm-up is one compiled scan: nothing
until it ends).
"""

from __future__ import annotations

import math
import re
import time
from pathlib import Path

import _harness as h
import numpy as np

MODEL = h.ROOT / "models" / "seird_metapop_counts.toml"
DATA = h.ROOT / "data" / "synthetic_metapop_20.nc"
RATE_PRIORS = {"kappa": (0.5, 1.0), "alpha": (0.05, 1.0), "gamma": (1.0, 1.0)}
SCALER_PRIOR = (1.0, 0.5)
WEIGHT_SD = 3.0 / math.sqrt(7.0)
RTOL, ATOL = 1e-5, 1e-8
MAX_STEPS = 16384
COMPARTMENTS = (("S", 1), ("E", 1), ("ID", 7), ("D", 1), ("IR", 5), ("R", 1))


def fit_config(rtol: float = RTOL, atol: float = ATOL, fix_neural=None) -> dict:
    """The fit configuration: the tolerances and every parameter's prior;
    with `fix_neural="all"` (or True), the MLP's weights fixed (at the MAP's
    values, when the sampler starts from a fit): the posterior of the rest
    given them; with `"hidden"`, its hidden layers only (a Bayesian last
    layer: the output layer's weights and bias sampled with the rest)."""
    params = {
        k: {"prior": {"family": "lognormal", "median": m, "sdlog": s}}
        for k, (m, s) in RATE_PRIORS.items()
    }
    m, s = SCALER_PRIOR
    params["scaler"] = {"prior": {"family": "lognormal", "median": m, "sdlog": s}}
    weights = {"prior": {"family": "normal", "mean": 0.0, "sd": WEIGHT_SD}}
    if fix_neural == "hidden":
        params["beta"] = {"fixed": "hidden", **weights}
    else:
        params["beta"] = {"fixed": True} if fix_neural else weights
    return {"rtol": rtol, "atol": atol, "parameters": params}


def problem():
    from epifit.data import open_dataset
    from epifit.simulation import Problem

    return Problem(MODEL, open_dataset(DATA))


def arrays(ds=None) -> dict:
    """The dataset in the reference problem's layout (float64 NumPy)."""
    if ds is None:
        import xarray as xr

        ds = xr.open_dataset(DATA).load()
    rows = []
    for name, stages in COMPARTMENTS:
        v = np.asarray(ds[f"initial_{name}"].values, np.float64)
        rows.append(v[None] if stages == 1 else v)
    return {
        "u0": np.concatenate(rows, axis=0),  # (16, patch)
        "t_days": np.arange(ds.sizes["time"], dtype=np.float64),
        "mobility": np.transpose(ds["mobility"].values, (1, 2, 0)),  # (patch, 7, day)
        "coupling": np.transpose(ds["coupling"].values, (1, 2, 0)),  # (p, q, day)
        "population": np.asarray(ds["population"].values, np.float64),
        "infections": np.asarray(ds["new_infections"].values[1:], np.float64),
        "deaths": np.asarray(ds["new_deaths"].values[1:], np.float64),
        "patches": [str(p) for p in ds["patch"].values],
    }


def reference_index(labels, patches) -> np.ndarray:
    """`index[i]`: the position in the reference's flat `p` of epifit's free
    parameter `labels[i]`, so that `p[index] = x` (a permutation)."""
    from reference.problem import LAYERS

    n = len(patches)
    offsets, off = [], 3 + n
    for n_in, n_out in zip(LAYERS[:-1], LAYERS[1:], strict=True):
        offsets.append((off, n_in, off + n_out * n_in))
        off += n_out * n_in + n_out
    named = {"kappa": 0, "alpha": 1, "gamma": 2}
    index = []
    for lab in labels:
        if lab in named:
            index.append(named[lab])
        elif m := re.fullmatch(r"scaler\[(.+)\]", lab):
            index.append(3 + patches.index(m[1]))
        elif m := re.fullmatch(r"beta\.layers\[(\d)\]\.weight\[(\d+),(\d+)\]", lab):
            w0, n_in, _ = offsets[int(m[1])]
            index.append(w0 + int(m[2]) * n_in + int(m[3]))
        elif m := re.fullmatch(r"beta\.layers\[(\d)\]\.bias\[(\d+)\]", lab):
            index.append(offsets[int(m[1])][2] + int(m[2]))
        else:
            raise ValueError(f"unknown free parameter label {lab!r}")
    if sorted(index) != list(range(off)):
        raise ValueError("epifit's free vector is not a permutation of the p")
    return np.asarray(index)


def from_epifit(x, labels, patches) -> np.ndarray:
    """epifit's free vector (its `labels`) as the reference's flat `p`."""
    index = reference_index(labels, patches)
    p = np.empty(index.size)
    p[index] = np.asarray(x, np.float64)
    return p


def true_p(patches) -> np.ndarray:
    """The reference's flat `p` of the data's true values (its attributes)."""
    import json

    import xarray as xr
    from reference.problem import softplus_inverse

    t = json.loads(xr.open_dataset(DATA).attrs["true_parameters"])
    rates = softplus_inverse([t["kappa"], t["alpha"], t["gamma"], *t["scaler"]])
    layers = t["beta"]["layers"]
    mlp = [np.ravel(lay[k]) for lay in layers for k in ("weight", "bias")]
    assert len(t["scaler"]) == len(patches)
    return np.concatenate([rates, *mlp])


def true_values() -> dict:
    """The data's true kappa, alpha and gamma (its attributes)."""
    import json

    import xarray as xr

    t = json.loads(xr.open_dataset(DATA).attrs["true_parameters"])
    return {k: float(t[k]) for k in ("kappa", "alpha", "gamma")}


def _log_prior(p, n: int, neural: bool = True):
    """Log prior of the constrained values plus the softplus log-Jacobians,
    without the normalising constants (as epifit's objective); the MLP's
    weights' only when they are sampled (`neural`)."""
    import jax
    import jax.numpy as jnp

    medians = [m for m, _ in RATE_PRIORS.values()] + [SCALER_PRIOR[0]] * n
    sdlogs = [s for _, s in RATE_PRIORS.values()] + [SCALER_PRIOR[1]] * n
    x = p[: 3 + n]
    c = jax.nn.softplus(x)
    z = (jnp.log(c) - jnp.log(jnp.asarray(medians))) / jnp.asarray(sdlogs)
    total = -jnp.sum(0.5 * z**2 + jnp.log(c)) + jnp.sum(jax.nn.log_sigmoid(x))
    if not neural:
        return total
    return total - 0.5 * jnp.sum(jnp.square(p[3 + n :] / WEIGHT_SD))


def _poisson(y, mu):
    import jax.numpy as jnp
    from jax.scipy.special import gammaln

    nz = y != 0
    xlogy = jnp.where(nz, y * jnp.log(jnp.where(nz, mu, 1.0)), 0.0)
    ok = jnp.isfinite(y)
    y0 = jnp.where(ok, y, 0.0)
    return jnp.sum(jnp.where(ok, xlogy - mu - gammaln(y0 + 1.0), 0.0))


def log_density(kind: str, A: dict, rtol=RTOL, atol=ATOL, max_steps=MAX_STEPS,
                neural: bool = True):  # fmt: skip
    """The hand-written log posterior `logp(p)` on `kind`'s solver
    (`diffrax` or `odeint`); without the MLP weights' prior unless `neural`
    (they are sampled)."""
    import jax.numpy as jnp
    from reference import peers, problem

    u0, ts = jnp.asarray(A["u0"]), jnp.asarray(A["t_days"])
    mob, cou = jnp.asarray(A["mobility"]), jnp.asarray(A["coupling"])
    pop, n = jnp.asarray(A["population"]), A["u0"].shape[1]
    y_i, y_d = jnp.asarray(A["infections"]), jnp.asarray(A["deaths"])
    if kind == "diffrax":
        import diffrax

        peer = peers.build("diffrax-tsit5", None, None, rtol=rtol, atol=atol,
                           max_steps=max_steps, throw=False)  # fmt: skip

        def solve(p):
            sol = peer.solve(p, u0, ts, mob, cou)
            return sol.ys, sol.result == diffrax.RESULTS.successful
    elif kind == "odeint":
        from jax.experimental.ode import odeint

        def vf(u, t, p):  # the covariates closed over as constants
            return problem.vector_field(u, t, p, mob, cou)

        def solve(p):
            return odeint(vf, u0, ts, p, rtol=rtol, atol=atol), True
    else:
        raise ValueError(f"unknown peer solver {kind!r}; expected diffrax or odeint")

    def logp(p):
        ys, ok = solve(p)
        mu_i = pop[None, :] * jnp.diff(1.0 - ys[:, 0, :], axis=0)
        mu_d = pop[None, :] * jnp.diff(ys[:, 9, :], axis=0)
        value = _poisson(y_i, mu_i) + _poisson(y_d, mu_d) + _log_prior(p, n, neural)
        return jnp.where(ok & jnp.isfinite(value), value, -jnp.inf)

    return logp


def epifit_map(rtol=RTOL, atol=ATOL, iterations: int = 400):
    """calibrate's MAP under `fit_config` (L-BFGS) from the data's true values
    (the synthetic data's; the MAP is near them), with the Laplace
    approximation that `epifit.sample` starts from."""
    import epifit

    h.reference_problem()  # tests/ importable, for `helpers`
    import helpers

    P = problem()
    start = helpers.params_from_flat(P.model, true_p(P.patches), P.n_patches)
    return epifit.calibrate(
        P, fit=fit_config(rtol, atol), init=start,
        optimizer=[{"method": "lbfgs", "iterations": iterations, "memory_size": 30}],
        seed=0, progress=False,
    )  # fmt: skip


def worker_epifit(a, fit_path: str) -> None:
    """epifit.sample from the MAP; a line per chunk (read from its checkpoint,
    which it writes after the warm-up and every chunk) and a final one."""
    import json
    import tempfile
    import threading

    import epifit

    ck = Path(tempfile.mkdtemp()) / "chains.npz"
    t = time.perf_counter()
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(ck, a, t, stop), daemon=True)
    watcher.start()
    post = epifit.sample(data=str(DATA), init=fit_path, chains=a.chains,
                         fit=fit_config(fix_neural=a.fix_neural),
                         mass_matrix=a.mass_matrix, whiten=not a.no_whiten,
                         warmup=a.warmup, draws=a.draws, seed=a.seed, chunk=a.block,
                         max_tree_depth=a.max_tree_depth,
                         chain_method=a.chain_method, checkpoint=ck,
                         progress=False)  # fmt: skip
    stop.set()
    watcher.join()
    timing = json.loads(post.data.posterior.attrs["timing"])
    p, st = post.data.posterior, post.data.sample_stats
    h.emit(
        {
            "chains": a.chains,
            "wall_s": time.perf_counter() - t,
            "sampling_s": timing["sampling_s"],
            "warmup_s": [float(v) for v in timing["warmup_s"]],
            "draws_s": [float(v) for v in timing["draws_s"]],
            "grads": [int(v) for v in st["n_steps"].sum("draw")],
            "draw_iterations": [a.draws] * a.chains,
            "draws": _epifit_draws(p),
            "divergences": int(st["diverging"].sum()),
        }
    )


def _watch(ck: Path, a, t0: float, stop) -> None:
    """Progress lines from epifit's checkpoint: per chain the draws done, their
    gradients, and the seconds from its warm-up's end to its last chunk."""
    seen, first, last = None, {}, {}
    while not stop.wait(1.0):
        try:
            stamp = ck.stat().st_mtime_ns
            if stamp == seen:
                continue
            seen, now = stamp, time.perf_counter()
            with np.load(ck, allow_pickle=False) as z:
                done = {c: int(z[f"chain{c}.done"]) for c in range(a.chains)
                        if f"chain{c}.done" in z}  # fmt: skip
                grads = {c: int(z[f"chain{c}.stat.n_steps"].sum()) for c in done}
                div = sum(int(z[f"chain{c}.stat.diverging"].sum()) for c in done)
        except (OSError, ValueError, KeyError):
            continue  # being replaced: the next poll reads it
        for c in done:
            first.setdefault(c, now)
            if done[c]:
                last[c] = now
        order = sorted(done)
        h.emit(
            {
                "chains": sum(done[c] >= a.draws for c in order),
                "progress": True,
                "sampling_s": now - t0,
                "warmup_ended_s": [first[c] - t0 for c in order],
                "draws_s": [last.get(c, first[c]) - first[c] for c in order],
                "grads": [grads[c] for c in order],
                "draw_iterations": [done[c] for c in order],
                "divergences": div,
            }
        )


def _epifit_draws(posterior) -> dict:
    """The reported parameters' draws `(chain, draw)` by name, as `named_draws`."""
    out = {k: posterior[k].values.tolist() for k in ("kappa", "alpha", "gamma")}
    scaler = np.asarray(posterior["scaler"].values)  # (chain, draw, patch)
    out |= {f"scaler[{k}]": scaler[..., k].tolist() for k in range(scaler.shape[-1])}
    return out


def sampled_start(fit_path: str, fix_neural, mass_matrix: str, whiten=False):
    """What `epifit.sample` starts from, by its own rules: the MAP fit, the
    labels and MAP values of the free vector sampled (conditional on the
    MLP's weights, or its hidden layers, with `fix_neural`), the first
    inverse mass matrix (the Laplace covariance, conditioned) and, with
    `whiten`, the root of that covariance the chains' coordinates are
    whitened by (`x = x_map + root @ z`, an identity first inverse mass
    matrix; None without), so that every tool starts the same."""
    from epifit import FitResult
    from epifit.fitting import fit_config as config_of
    from epifit.fitting import resolve_fit
    from epifit.sampling._density import whitening
    from epifit.sampling._nuts import NutsSettings, initial_inverse_mass
    from epifit.sampling._sample import _conditioned

    fit = FitResult.from_netcdf(fit_path, data=str(DATA))
    config = config_of(fit_config(fix_neural=fix_neural))
    free = resolve_fit(fit.problem, config, init=fit.params).objective.free
    x, cov = _conditioned(fit, free)
    roots = whitening(cov) if whiten else None
    settings = NutsSettings(mass_matrix=mass_matrix)
    imm = initial_inverse_mass(None if roots else cov, x.size, settings)
    return fit, free.labels, x, imm, None if roots is None else roots[0]


def on_sampled(logp_p, p_map, at):
    """`logp_p` (of the reference's `p`) as a function of the sampled
    coordinates `q`: `p_map` with `p[at] = q` (a gather: `at` is where each
    sampled label sits in `p`)."""
    import jax.numpy as jnp

    p_map = jnp.asarray(p_map)
    return lambda q: logp_p(p_map.at[at].set(q))


def worker_numpyro(a, kind: str, fit_path: str) -> None:
    """numpyro's NUTS over epifit's sampled coordinates `q` (the same order,
    start and first inverse mass matrix), mapped into the reference's `p`
    (the MAP's values for the rest) by a gather."""
    import jax
    import jax.numpy as jnp
    from numpyro.infer.hmc import hmc

    A = arrays()
    fit, labels, x0, imm, root = sampled_start(
        fit_path, a.fix_neural, a.mass_matrix, whiten=not a.no_whiten
    )
    p_map = from_epifit(fit.x, fit.labels, A["patches"])
    index = reference_index(fit.labels, A["patches"])
    at = index[[fit.labels.index(s) for s in labels]]
    neural = a.fix_neural != "all"  # the weights' prior: constant if all fixed
    logp = on_sampled(log_density(kind, A, neural=neural), p_map, at)
    to_q = (lambda z: z) if root is None else _affine(x0, root)
    if root is not None:  # epifit's whitened coordinates z, from the MAP z = 0
        x0 = np.zeros_like(x0)
    init_kernel, sample_kernel = hmc(potential_fn=lambda z: -logp(to_q(z)),
                                     algo="NUTS")  # fmt: skip
    run = _Run(a, A, p_map, at, to_q)
    for c in range(a.chains):
        key = jax.random.fold_in(jax.random.key(a.seed), c)
        t = time.perf_counter()
        state = init_kernel(jnp.asarray(x0), num_warmup=a.warmup,
                            inverse_mass_matrix=jnp.asarray(imm),
                            dense_mass=a.mass_matrix == "dense",
                            target_accept_prob=0.8,
                            max_tree_depth=a.max_tree_depth,
                            rng_key=key)  # fmt: skip
        run.compile_s += time.perf_counter() - t
        if run.block is None:
            t = time.perf_counter()
            run.block = _compiled_block(sample_kernel, state, 1)
            run.compile_s += time.perf_counter() - t
        run.emit(c, np.zeros((0, x0.size)))  # compiled: a stopped peer says so
        run.chain(c, state)


def _affine(shift, root):
    """`z -> shift + root @ z`, for JAX and NumPy arrays (a batch of rows)."""
    import jax.numpy as jnp

    shift, root = np.asarray(shift), np.asarray(root)

    def to_q(z):
        if isinstance(z, np.ndarray):
            return shift + z @ root.T
        return jnp.asarray(shift) + z @ jnp.asarray(root).T

    return to_q


def _compiled_block(sample_kernel, state, n: int):
    import jax

    def block(s):
        def body(s, _):
            s = sample_kernel(s)
            return s, (s.z, s.num_steps, s.diverging)

        return jax.lax.scan(body, s, None, length=n)

    return jax.jit(block).lower(state).compile()


class _Run:
    """A numpyro worker's tallies, emitted after every block."""

    def __init__(self, a, A, p_map, at, to_q=lambda z: z):
        self.a, self.n = a, len(A["patches"])
        self.p_map, self.at = p_map, at  # q (the sampled coordinates) into p
        self.to_q = to_q  # the sampler's coordinates into q
        self.block, self.compile_s, self.t0 = None, 0.0, time.perf_counter()
        self.warmup_s, self.draws_s, self.warm_grads, self.grads = [], [], [], []
        self.iters, self.total, self.divergences, self.done = [], [], 0, 0
        self.draws: dict[str, list] = {}

    def chain(self, c: int, state) -> None:
        a = self.a
        for lst in (self.warmup_s, self.draws_s, self.warm_grads, self.grads):
            lst.append(0)
        self.iters.append(0)
        self.total.append(0)
        zs, i = [], 0
        while i < a.warmup + a.draws:
            t = time.perf_counter()
            state, (z, steps, div) = self.block(state)
            z, steps, div = jax_get(z, steps, div)
            dt = time.perf_counter() - t
            phase = np.arange(i, i + 1) < a.warmup
            share = phase.mean()
            self.warmup_s[c] += dt * share
            self.draws_s[c] += dt * (1 - share)
            self.warm_grads[c] += int(steps[phase].sum())
            self.grads[c] += int(steps[~phase].sum())
            self.divergences += int(div[~phase].sum())
            zs.append(z[~phase])
            i += 1
            self.iters[c] = max(0, i - a.warmup)
            self.total[c] = i
            self.emit(c, np.concatenate(zs)[: a.draws])
        self.done = c + 1
        self.emit(c, np.concatenate(zs)[: a.draws])

    def emit(self, c: int, z) -> None:
        """A line with the tallies so far and the draws of the complete chains."""
        if c + 1 == self.done:  # chain c just finished: keep its draws
            p = np.broadcast_to(self.p_map, (*z.shape[:-1], self.p_map.size)).copy()
            p[..., self.at] = self.to_q(np.asarray(z, np.float64))
            for k, v in named_draws(p[None], self.n).items():
                self.draws.setdefault(k, []).extend(v)
        h.emit(
            {
                "chains": self.done,
                "chain": c,
                "sampling_s": time.perf_counter() - self.t0,
                "compile_s": self.compile_s,
                "warmup_s": self.warmup_s,
                "draws_s": self.draws_s,
                "warmup_grads": self.warm_grads,
                "grads": self.grads,
                "draw_iterations": self.iters,
                "iterations": self.total,
                "draws": self.draws,
                "divergences": self.divergences,
            }
        )


def named_draws(z, n: int) -> dict:
    """The reported parameters' constrained draws `(chain, draw)` by name
    (`scaler[k]` per patch) from the reference's `p` draws `(chain, draw, p)`."""
    c = np.logaddexp(0.0, np.asarray(z)[..., : 3 + n])
    out = {k: c[..., i].tolist() for i, k in enumerate(("kappa", "alpha", "gamma"))}
    out |= {f"scaler[{k}]": c[..., 3 + k].tolist() for k in range(n)}
    return out


def jax_get(*xs):
    import jax

    return [np.asarray(v) for v in jax.device_get(xs)]
