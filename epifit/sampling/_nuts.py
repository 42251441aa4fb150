"""NUTS chains (blackjax): window adaptation, then draws, in compiled chunks
of transitions, checkpointed between chunks once the warm-up is done.

Every chain runs the same compiled program: a chunk of `chunk` NUTS
transitions (a `lax.scan`), each a warm-up transition followed by its update
of the step size and mass matrix (Stan's window adaptation, `_adapt.py`) or a
draw. The data are traced arguments, so a chain, a chunk and a resumed run
reuse it. The key of draw `i` of chain `c` is `fold_in(fold_in(key(seed), c),
i)` and a warm-up transition's key and adaptation depend on its index alone:
the draws do not depend on the chunking, and a resumed run gives the same
numbers.
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
from blackjax.mcmc.hmc import HMCState

from epifit._jit import jit
from epifit.sampling._adapt import DRAW, INITIAL_STEP_SIZE, codes, engine, like

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


def max_drop(n: int) -> float:
    """How far below the anchor's (the MAP's) log density a chain may begin,
    in `n` coordinates: half of `n + 10 sqrt(2 n) + 20`. For a Gaussian
    posterior a draw of its Laplace approximation falls `chi2_n / 2` below
    the MAP, past this bound with probability below 1e-8 for every `n`
    (3e-9 at `n = 1`, 1e-17 at `n = 199`), so it never moves such a draw."""
    return 0.5 * (n + 10.0 * math.sqrt(2.0 * n) + 20.0)


def begin_state(x0, anchor, logp, dtype) -> HMCState:
    """The state a chain begins from: the density and its gradient at `x0`,
    or, where they are not finite there or the log density lies more than
    `max_drop(x0.size)` below `anchor`'s, at the first of `anchor + t (x0 -
    anchor)`, `t = 1/2, 1/4, ...` (`MAX_SHRINKS` halvings, then `anchor`
    itself) where it does not.

    A draw of the Laplace approximation can land where the log density is
    not finite (a solve that fails, a zero likelihood where cases are
    observed: a wide covariance along a weakly identified direction, such as
    a neural network's weights, makes it likely), and a chain started there
    never moves; or where it is finite but far out of the posterior's bulk
    (the approximation at a saddle: on the 20-patch model's MLP a draw fell
    2.9e7 below the MAP's log density, and the warm-up adapted its step size
    to 6e-8 there, so the chain stayed). `anchor` is the MAP (in the chains'
    coordinates); its density, evaluated first (by the same code, so the
    program holds one copy of the density), is the reference, and with none
    finite there only finiteness is asked for. Traced in the chains' program
    (its `begin`), so the start is checked by the same evaluation that
    begins the chain, with no program of its own. A state still not finite
    at `anchor` comes back with a NaN position and log density, which every
    transition keeps (a NaN point stays one), so that `check_begun` reports
    it after the chunk. Deterministic: a resumed run begins from the same
    point.
    """
    x0, anchor = jnp.asarray(x0, dtype), jnp.asarray(anchor, dtype)
    drop = jnp.asarray(max_drop(x0.size), dtype)

    def finite(state):
        return jnp.isfinite(state.logdensity) & jnp.all(
            jnp.isfinite(state.logdensity_grad)
        )

    def good(state, ref):
        return finite(state) & (state.logdensity >= ref - drop)

    def point(k):  # k = -1: the anchor (the reference); 0: x0; then halvings
        t = jnp.where(k < MAX_SHRINKS, 0.5 ** k.astype(dtype), 0).astype(dtype)
        shrunk = anchor + t * (x0 - anchor)
        return jnp.where(k < 0, anchor, jnp.where(k == 0, x0, shrunk))

    def body(c):
        k, state, ref = c
        state = like(blackjax.nuts.init(point(k), logp), state)
        lp = jnp.where(finite(state), state.logdensity, -jnp.inf)
        return k + 1, state, jnp.where(k < 0, lp, ref)

    blank = HMCState(x0, jnp.asarray(-jnp.inf, dtype), jnp.zeros_like(x0))
    first = (-jnp.ones((), jnp.int32), blank, jnp.asarray(-jnp.inf, dtype))

    def cond(c):  # carry `k` holds the state of `point(k - 1)`
        k, state, ref = c
        return (k <= MAX_SHRINKS) & ((k <= 0) | ~good(state, ref))

    _, state, ref = jax.lax.while_loop(cond, body, first)
    ok = good(state, ref)
    nan = jnp.asarray(jnp.nan, dtype)
    return HMCState(
        jnp.where(ok, state.position, nan),
        jnp.where(ok, state.logdensity, nan),
        state.logdensity_grad,
    )


def check_begun(carry) -> None:
    """Raise if a chain's begun state (its carry after the first chunk) is
    not finite: the log posterior is not finite at the MAP either."""
    state = carry[0]
    if not np.isfinite(np.asarray(state.logdensity)).all():
        raise FloatingPointError(
            "The log posterior is not finite at the MAP the chains start from "
            f"(log density {np.asarray(state.logdensity).tolist()!r}); check the "
            "fit (init) and its data."
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
    """The one compiled program of a run, over a log density
    `logdensity(x, data)`: `steps(carry, chain, start, data)` runs chain
    `chain`'s transitions `start .. start + chunk - 1`, the warm-up's (window
    adaptation, `_adapt.py`) and the draws' alike, and returns the carry and
    every transition's position and `STATS`; `steps_chains` is the same vmapped
    over the carries and chains (`start` shared). At `start` 0 the carry's
    position is the start and its inverse mass matrix the first one (`fresh`);
    the program evaluates the density there (pulled towards `anchor`, the MAP,
    where it is not finite or far below the MAP's: `begin_state`) and begins
    the adaptation. One program, so NUTS and the gradient are compiled once:
    the warm-up as its own `lax.scan` (blackjax's `window_adaptation`) and a
    chunk of draws were two programs, each compiling both (boarding school:
    2.97 + 2.25 s of lowering and compiling, against 1.5 s for one
    `value_and_grad`)."""

    def __init__(self, logdensity: Callable, settings: NutsSettings, anchor=None):
        self.settings = s = settings
        # where a start whose density is not finite or too low is pulled to
        # (None: the start itself, no pull); an argument of the program, not a constant
        self.anchor = None if anchor is None else np.asarray(anchor)
        self._anchors: dict = {}  # on the device, by carry shape and dtype
        # The density under `jax.jit`, so the program traces the solve and
        # its adjoint once: blackjax traces its integrator's loop body three
        # times (the loop's carry starts weakly typed) and its `init` once,
        # and the later traces of a jitted function at the same shapes are
        # cache hits. Boarding school: lowering 1.2 -> 0.65 s, the same
        # compiled program and draws.
        logdensity = jax.jit(logdensity)
        kernel = blackjax.nuts.build_kernel()
        adapt_init, adapt_update = engine(s.diagonal, s.target_accept)
        # each transition's code: the warm-up's schedule, then draws
        table = np.append(codes(s.warmup), DRAW).astype(np.int32)
        depth = s.max_tree_depth

        def steps(carry, chain, start, data, anchor):
            def logp(x):
                return logdensity(x, data)

            def begin(carry):
                state, _, _, imm0 = carry
                dt = carry[2].dtype
                new = begin_state(state.position, anchor, logp, dt)
                size = jnp.asarray(INITIAL_STEP_SIZE, dt)
                return like((new, adapt_init(new.position, imm0), size, imm0), carry)

            carry = jax.lax.cond(start == 0, begin, lambda c: c, carry)
            index = start + jnp.arange(s.chunk)
            keys = transition_keys(s.seed, chain, index, s.warmup)
            code = jnp.asarray(table)[jnp.minimum(index, s.warmup)]

            def one(carry, xs):
                key, code = xs
                state, _, size, imm = carry
                state, info = kernel(key, state, logp, size, imm, depth)

                def adapting(params):
                    rate = info.acceptance_rate
                    return adapt_update(params[0], code, state.position, rate)

                params = jax.lax.cond(code == DRAW, lambda p: p, adapting, carry[1:])
                stats = (
                    state.logdensity,
                    info.is_divergent,
                    info.num_trajectory_expansions,
                    info.num_integration_steps,
                    info.energy,
                    info.acceptance_rate,
                )
                return like((state, *params), carry), (state.position, stats)

            return jax.lax.scan(one, carry, (keys, code))

        self._steps = jit(steps)
        # every chain in one program (chain_method="vectorized"): compiled on
        # first use only
        self._steps_chains = jit(jax.vmap(steps, in_axes=(0, 0, None, None, 0)))
        self._adapt_init = adapt_init

    def steps(self, carry, chain, start, data):
        """Chain `chain`'s transitions `start .. start + chunk - 1` (the
        compiled program)."""
        return self._steps(carry, chain, start, data, self._anchor(carry[0]))

    def steps_chains(self, carries, chains, start, data):
        """`steps` of every chain of `chains` (their carries stacked), in one
        vmapped program."""
        anchor = self._anchor(carries[0])
        return self._steps_chains(carries, chains, start, data, anchor)

    def _anchor(self, state):
        """The program's anchor argument for carries like `state`'s: put on
        the device once per shape and dtype, not at every chunk (None: the
        position itself)."""
        x = state.position
        if self.anchor is None:
            return x
        key = (x.shape, str(x.dtype))
        if key not in self._anchors:
            a = np.broadcast_to(self.anchor, x.shape).astype(x.dtype)
            self._anchors[key] = jax.device_put(a)
        return self._anchors[key]

    def fresh(self, x0, imm0):
        """The carry of a chain not begun: its start `x0` and the first
        inverse mass matrix `imm0` (the rest is filled in by the program)."""
        x0 = np.asarray(x0)
        zero = np.zeros((), x0.dtype)
        return self._carry(HMCState(x0, zero, np.zeros_like(x0)), zero, imm0)

    def resumed(self, snap: dict):
        """The carry of a chain after its warm-up, from its snapshot."""
        state = HMCState(*(np.asarray(v) for v in snap["state"]))
        size = np.asarray(snap["step_size"], state.position.dtype)
        return self._carry(state, size, snap["inverse_mass_matrix"])

    def _carry(self, state, size, imm):
        """`(state, adaptation, step size, inverse mass matrix)` on the
        device, as NumPy strongly typed arrays make it (the types the program
        keeps), the adaptation's zeros (the program begins it at `start`
        0)."""
        x = state.position
        imm = np.asarray(imm, x.dtype)
        template = jax.eval_shape(self._adapt_init, x, imm)
        adapt = jax.tree.map(lambda v: np.zeros(v.shape, v.dtype), template)
        return jax.device_put((state, adapt, size, imm))


def transition_keys(seed: int, chain, index, warmup: int):
    """The keys of transitions `index` of chain `chain`: warm-up transition
    `i` takes the `i`-th of `warmup` keys split from the warm-up's key (as
    blackjax's window adaptation would), draw `j = i - warmup` the key
    `fold_in(fold_in(key(seed), chain), j)`."""
    base = jax.random.fold_in(jax.random.key(seed), chain)
    draws = jax.vmap(lambda i: jax.random.fold_in(base, i))(index - warmup)
    if warmup == 0:
        return draws
    split = jax.random.split(jax.random.fold_in(base, WARMUP_STREAM), warmup)
    warm = split[jnp.minimum(index, warmup - 1)]
    data = jnp.where((index < warmup)[:, None], jax.random.key_data(warm),
                     jax.random.key_data(draws))  # fmt: skip
    return jax.random.wrap_key_data(data)


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


def transitions(settings: NutsSettings) -> int:
    """The transitions run: the warm-up and `draws`, rounded up to whole
    chunks."""
    whole = settings.warmup + settings.draws
    return math.ceil(whole / settings.chunk) * settings.chunk


def total_draws(settings: NutsSettings) -> int:
    """The draws run (at least `draws`)."""
    return transitions(settings) - settings.warmup


def advanced(snap: dict | None, chain: int, carry, start: int, out, s: NutsSettings):
    """Chain `chain`'s snapshot after its transitions `start .. start + chunk
    - 1` ran (`carry`, `out`: the program's results), None while it is still
    in its warm-up; `snap`: its snapshot before (None: none yet)."""
    if start + s.chunk < s.warmup:
        return None
    state, _, size, imm = carry
    if snap is None:
        snap = new_snapshot(chain, state, size, imm)
    skip = max(s.warmup - start, 0)
    pos, stats = out
    return extended(snap, state, np.asarray(pos)[skip:],
                    [np.asarray(v)[skip:] for v in stats], s.chunk - skip)  # fmt: skip


def run_chain(
    programs: Programs,
    chain: int,
    x0,
    imm0,
    data,
    *,
    resume: dict | None = None,
    on_chunk: Callable[[dict], None] | None = None,
    on_progress: Callable[[int], None] | None = None,
) -> dict:
    """Chain `chain` from `x0` (first inverse mass matrix `imm0`), or from
    the snapshot `resume` after its warm-up: chunk after chunk of
    transitions; `on_chunk(snapshot)` after each chunk that ends past the
    warm-up, with the chain's state so far (what a checkpoint saves);
    `on_progress(transitions)` at the start and after every chunk, with the
    transitions done (warm-up included: a progress bar's).
    Returns `positions (draw, n)`, the `STATS` `(draw,)`, `step_size`,
    `inverse_mass_matrix` and the wall times `warmup_s` (to the end of the
    chunk that ends the warm-up: the first chain's includes the compile) and
    `draws_s`."""
    s = programs.settings
    t0 = t1 = time.perf_counter()
    if resume is None:
        carry, start, snap = programs.fresh(x0, imm0), 0, None
    else:
        carry, start, snap = programs.resumed(resume), s.warmup + resume["done"], resume
    if on_progress is not None:
        on_progress(start)
    while start < transitions(s):
        carry, out = programs.steps(carry, chain, start, data)
        if start == 0:
            check_begun(carry)
        new = advanced(snap, chain, carry, start, out, s)
        start += s.chunk
        if on_progress is not None:
            on_progress(start)
        if new is None:
            continue
        if snap is None:
            t1 = time.perf_counter()
        snap = new
        if on_chunk is not None:
            on_chunk(snap)
    return chain_result(snap, s, t1 - t0, time.perf_counter() - t1)
