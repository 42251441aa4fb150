"""NUTS chains (blackjax): window adaptation, then draws in compiled chunks,
checkpointed between chunks.

Every chain runs the same two compiled programs: the warm-up (blackjax's
window adaptation of the step size and the mass matrix, one `lax.scan`) and a
chunk of `chunk` draws (a `lax.scan` of NUTS transitions). The data are
traced arguments, so a chain, a chunk and a resumed run reuse them. The key
of draw `i` of chain `c` is `fold_in(fold_in(key(seed), c), i)`: the draws do
not depend on the chunking, and a resumed run gives the same numbers.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

import blackjax
import jax
import jax.numpy as jnp
import numpy as np

from epifit._jit import jit

__all__ = ["NutsSettings", "Programs", "STATS", "run_chain", "start_points"]

MASS_MATRICES = ("diagonal", "dense")
# per-draw statistics, named as ArviZ's sample_stats group names them
STATS = (
    "lp",
    "diverging",
    "tree_depth",
    "n_steps",
    "energy",
    "acceptance_rate",
)
WARMUP_STREAM = 1 << 20  # the warm-up's key, apart from the draws' keys


@dataclasses.dataclass(frozen=True)
class NutsSettings:
    """The sampler's settings (see `epifit.sample`)."""

    chains: int = 4
    warmup: int = 500
    draws: int = 1000
    seed: int = 0
    mass_matrix: str = "diagonal"
    target_accept: float = 0.8
    max_tree_depth: int = 10
    chunk: int = 50

    def __post_init__(self):
        for name in ("chains", "warmup", "draws", "chunk", "max_tree_depth"):
            v = getattr(self, name)
            low = 0 if name == "warmup" else 1
            if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < low:
                raise ValueError(f"{name} must be an int >= {low}; got {v!r}")
        if self.mass_matrix not in MASS_MATRICES:
            raise ValueError(
                f"mass_matrix must be one of {MASS_MATRICES}; got {self.mass_matrix!r}"
            )
        if not 0.0 < float(self.target_accept) < 1.0:
            raise ValueError(
                f"target_accept must lie in (0, 1); got {self.target_accept!r}"
            )

    @property
    def diagonal(self) -> bool:
        return self.mass_matrix == "diagonal"


def start_points(x_map, covariance, settings: NutsSettings) -> np.ndarray:
    """A start per chain: a draw from the Laplace approximation `Normal(x_map,
    covariance)` (`covariance` None: a 0.1 standard deviation in every
    unconstrained coordinate), chain 0 included, so the chains start
    dispersed as R-hat needs."""
    x_map = np.asarray(x_map, np.float64)
    rng = np.random.default_rng([settings.seed, 0x5A3])
    z = rng.standard_normal((settings.chains, x_map.size))
    if covariance is None:
        return x_map + 0.1 * z
    cov = np.asarray(covariance, np.float64)
    w, v = np.linalg.eigh((cov + cov.T) / 2)
    root = v * np.sqrt(np.clip(w, 0.0, None))
    return x_map + z @ root.T


MAX_SHRINKS = 20


def finite_start_points(starts, x_map, loss, data) -> np.ndarray:
    """`starts` with every non-finite one pulled towards the MAP.

    A draw of the Laplace approximation can land where the log density is
    not finite (a solve that fails, a zero likelihood where cases are
    observed: a wide covariance along a weakly identified direction, such as
    a neural network's weights, makes it likely), and a chain started there
    never moves. Such a start is replaced by the MAP plus half its offset,
    again while it stays non-finite; after `MAX_SHRINKS` halvings it is the
    MAP itself. `loss(xs, data)` is the objective at a batch of points (the
    negative log density up to the log-Jacobian, finite where it is).
    Deterministic, so a resumed run finds the same starts.

    Raises:
        FloatingPointError: the loss is not finite at the MAP either.
    """
    starts = np.asarray(starts, np.float64)
    x_map = np.asarray(x_map, np.float64)
    xs = starts.copy()
    for k in range(1, MAX_SHRINKS + 2):
        f = np.asarray(loss(jnp.asarray(xs, x_map.dtype), data))
        bad = ~np.isfinite(f)
        if not bad.any():
            return xs
        if k > MAX_SHRINKS:
            break
        t = 0.5**k if k < MAX_SHRINKS else 0.0
        xs[bad] = x_map + t * (starts[bad] - x_map)
    raise FloatingPointError(
        "The log posterior is not finite at the MAP the chains start from "
        f"(loss {f[bad][0]!r}); check the fit (init) and its data."
    )


def initial_inverse_mass(covariance, n: int, settings: NutsSettings):
    """The first window's inverse mass matrix: the Laplace covariance (its
    diagonal for a diagonal one), identity without one."""
    if covariance is None:
        return np.ones(n) if settings.diagonal else np.eye(n)
    cov = np.asarray(covariance, np.float64)
    if not np.all(np.isfinite(cov)) or np.any(np.diag(cov) <= 0):
        return np.ones(n) if settings.diagonal else np.eye(n)
    return np.diag(cov).copy() if settings.diagonal else (cov + cov.T) / 2


class Programs:
    """The two compiled programs of a chain, over a log density
    `logdensity(x, data)`: `warm` (or `init` without a warm-up) and `chunk`;
    `warm_chains`, `init_chains` and `chunk_chains` are the same vmapped over
    a leading chain axis."""

    def __init__(self, logdensity: Callable, settings: NutsSettings):
        self.settings = settings
        depth = settings.max_tree_depth

        def warm(key, x0, imm0, data):
            adapt = blackjax.window_adaptation(
                blackjax.nuts,
                lambda x: logdensity(x, data),
                is_mass_matrix_diagonal=settings.diagonal,
                initial_inverse_mass_matrix=imm0,
                target_acceptance_rate=settings.target_accept,
                max_num_doublings=depth,
                adaptation_info_fn=_no_info,
            )
            (state, params), _ = adapt.run(key, x0, num_steps=settings.warmup)
            return state, params["step_size"], params["inverse_mass_matrix"]

        def chunk(state, keys, step_size, imm, data):
            kernel = blackjax.nuts(
                lambda x: logdensity(x, data),
                step_size,
                imm,
                max_num_doublings=depth,
            )

            def one(state, key):
                state, info = kernel.step(key, state)
                stats = (
                    state.logdensity,
                    info.is_divergent,
                    info.num_trajectory_expansions,
                    info.num_integration_steps,
                    info.energy,
                    info.acceptance_rate,
                )
                return state, (state.position, stats)

            return jax.lax.scan(one, state, keys)

        def init(x0, data):
            return blackjax.nuts.init(x0, lambda x: logdensity(x, data))

        self.warm = jit(warm)
        self.chunk = jit(chunk)
        self.init = jit(init)
        # every chain in one program (chain_method="vectorized"): the same
        # functions vmapped over the chains, the data shared; compiled on
        # first use only
        self.warm_chains = jit(jax.vmap(warm, in_axes=(0, 0, None, None)))
        self.chunk_chains = jit(jax.vmap(chunk, in_axes=(0, 0, 0, 0, None)))
        self.init_chains = jit(jax.vmap(init, in_axes=(0, None)))


def _no_info(state, info, adaptation_state):
    return None


def draw_keys(seed: int, chain: int, start: int, count: int):
    """The keys of draws `start .. start + count - 1` of chain `chain`."""
    base = jax.random.fold_in(jax.random.key(seed), chain)
    return jax.vmap(lambda i: jax.random.fold_in(base, i))(
        jnp.arange(start, start + count)
    )


def warmup_key(seed: int, chain: int):
    """The key of chain `chain`'s warm-up (apart from its draws' keys)."""
    return jax.random.fold_in(
        jax.random.fold_in(jax.random.key(seed), chain), WARMUP_STREAM
    )


def new_snapshot(chain: int, state, step_size, inverse_mass_matrix) -> dict:
    """A chain's state after its warm-up, before any draw."""
    return {
        "chain": chain,
        "done": 0,
        "state": state,
        "step_size": step_size,
        "inverse_mass_matrix": inverse_mass_matrix,
        "positions": [],
        "stats": [],
    }


def extended(snap: dict, state, positions, stats, count: int) -> dict:
    """`snap` after `count` more draws (`positions (count, n)`, `stats`)."""
    return {
        **snap,
        "state": state,
        "done": snap["done"] + count,
        "positions": [*snap["positions"], np.asarray(positions)],
        "stats": [*snap["stats"], [np.asarray(v) for v in stats]],
    }


def chain_result(snap: dict, settings: NutsSettings, warmup_s, draws_s) -> dict:
    """A finished chain's draws, as `run_chain` returns them."""
    positions = np.concatenate(snap["positions"])[: settings.draws]
    stats = {
        name: np.concatenate([c[i] for c in snap["stats"]])[: settings.draws]
        for i, name in enumerate(STATS)
    }
    return {
        "positions": positions,
        "stats": stats,
        "step_size": float(snap["step_size"]),
        "inverse_mass_matrix": np.asarray(snap["inverse_mass_matrix"]),
        "warmup_s": warmup_s,
        "draws_s": draws_s,
    }


def total_draws(settings: NutsSettings) -> int:
    """The draws run: `draws` rounded up to whole chunks."""
    return math.ceil(settings.draws / settings.chunk) * settings.chunk


def run_chain(
    programs: Programs,
    chain: int,
    x0,
    imm0,
    data,
    *,
    resume: dict | None = None,
    on_chunk: Callable[[dict], None] | None = None,
) -> dict:
    """Chain `chain` from `x0`: warm-up (unless `resume` holds its result),
    then the draws chunk by chunk; `on_chunk(snapshot)` after each chunk (and
    after the warm-up) with the chain's state so far (what a checkpoint
    saves). Returns `positions (draw, n)`, the `STATS` `(draw,)`, `step_size`,
    `inverse_mass_matrix` and the wall times `warmup_s`, `draws_s`."""
    s = programs.settings
    t0 = time.perf_counter()
    if resume is None:
        if s.warmup:
            key = warmup_key(s.seed, chain)
            state, step, imm = programs.warm(key, jnp.asarray(x0), imm0, data)
        else:
            state, step, imm = programs.init(jnp.asarray(x0), data), 1.0, imm0
            step = jnp.asarray(step, jnp.asarray(x0).dtype)
        snap = new_snapshot(chain, state, step, imm)
        if on_chunk is not None:
            on_chunk(snap)
        jax.block_until_ready(state)
    else:
        snap = resume
    t1 = time.perf_counter()
    while snap["done"] < total_draws(s):
        keys = draw_keys(s.seed, chain, snap["done"], s.chunk)
        state, (pos, stats) = programs.chunk(
            snap["state"], keys, snap["step_size"], snap["inverse_mass_matrix"], data
        )
        snap = extended(snap, state, pos, stats, s.chunk)
        if on_chunk is not None:
            on_chunk(snap)
    # the first chain's warm-up includes the compiles
    return chain_result(snap, s, t1 - t0, time.perf_counter() - t1)
