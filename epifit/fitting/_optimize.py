"""The optimiser loop: phases of methods, run jitted in chunks of iterations.

Each phase compiles one function that runs up to `k` iterations of its method
inside a `lax.while_loop` (for every start: one after another on CPU, batched
by `vmap` elsewhere; see `epifit._vmap.default_group`) and records the
loss, gradient norm and step of each iteration. Between chunks the host updates
the progress bar, writes checkpoints and checks the time budget. Chunk sizes
adapt to the cost of an iteration (about one chunk per `target_seconds`) but
never change the numbers: an iteration is the same compiled computation
whichever chunk it falls in, so a run resumed from a checkpoint reproduces an
uninterrupted one exactly.

An iteration is one trip of the loop (one evaluation of the objective) that
the method counts (`StepInfo.counted`): every trip of the first-order methods
and Levenberg-Marquardt; for L-BFGS an accepted step or a retreat from a
non-finite trial point, not a trial that its backtracking rejects (those are
part of an iteration, as in a line search). Phase `iterations`,
`max_iterations`, `patience`, the histories and the checkpoint intervals all
count iterations.

Robustness: a step whose loss or gradient is not finite is rejected; the state
retreats to the last good point and the step is halved (first-order methods
and the L-BFGS trial step) or the Levenberg-Marquardt damping grows. After
`max_retreats` rejections in a row the start stops, keeping its last good state.

Every start also carries the best point it has seen (`Carry.best_x`,
`Carry.best_f`: the lowest finite loss over all iterations and phases, the
starting point included), so that a method that wanders uphill (a first-order
step too large for the loss, say) cannot lose it; `calibrate` returns it when
the last iterate is worse (`_calibrate.best_points`). Tracking it adds outputs to the
compiled loop and changes none of the iterates.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from epifit._jit import jit
from epifit._vmap import vmap_batch
from epifit.fitting._config import PhaseConfig
from epifit.fitting._diagnose import NonFiniteStartError
from epifit.fitting._methods import (
    AbstractLeastSquaresMethod,
    AbstractMethod,
    make_method,
)
from epifit.fitting._record import append_history, new_record

__all__ = [
    "Carry",
    "NonFiniteStartError",
    "OptimizeOptions",
    "Optimizer",
    "STATUS",
]

RUNNING, GRADIENT, LOSS, NONFINITE = 0, 1, 2, 3
STATUS = {
    RUNNING: "running",
    GRADIENT: "gradient below tolerance",
    LOSS: "loss change below tolerance",
    NONFINITE: "non-finite loss or gradient persisted",
}
CAPACITY = 256  # the most iterations one compiled chunk runs (history buffer)


class Carry(eqx.Module):
    """The state of one start between iterations (batched over starts)."""

    x: jax.Array
    f: jax.Array
    g: jax.Array
    state: Any
    scale: jax.Array  # retreat factor applied to steps (1 = full steps)
    n_bad: jax.Array  # consecutive rejected steps
    n_flat: jax.Array  # consecutive iterations with a small loss change
    iteration: jax.Array  # iterations done in this phase
    status: jax.Array
    fresh: jax.Array  # (`evaluates_start` methods) not evaluated yet: evaluate, no step
    best_x: jax.Array  # the point of the lowest finite loss seen (all phases)
    best_f: jax.Array  # that loss (inf before the first finite one)


@dataclasses.dataclass(frozen=True)
class OptimizeOptions:
    tolerance: float = 1e-8  # max|grad| <= tolerance * max(1, |loss|)
    loss_tolerance: float = 1e-12  # |Δloss| <= loss_tolerance * max(1, |loss|)
    patience: int = 5  # ... for this many iterations in a row
    max_iterations: int | None = None  # over all phases
    time_budget: float | None = None  # seconds, checked between chunks
    max_retreats: int = 30
    chunk_size: int | None = None  # fixed iterations per chunk (default adaptive)
    target_seconds: float = 0.5


def _phase_settings(phase: PhaseConfig, options: OptimizeOptions) -> tuple:
    return (
        options.tolerance if phase.tolerance is None else phase.tolerance,
        options.loss_tolerance
        if phase.loss_tolerance is None
        else phase.loss_tolerance,
        options.patience if phase.patience is None else phase.patience,
    )


class Optimizer:
    """Runs the phases of a fit on a batch of starting points.

    Args:
        fun: the objective (`loss`, `value_and_grad`, `residuals_and_jacobian`,
            `compiled`, and optionally `group`: how many starts to batch
            together, see `vmap_batch`; without it all are batched).
        phases: the phases, in order.
        options: tolerances and budgets.
        progress: a callback `(event, info)` for the progress display, or None.
        checkpoint: a callback `(snapshot)` called at checkpoint iterations.
        checkpoint_every: iterations between checkpoints (global count).
    """

    def __init__(
        self,
        fun,
        phases: Sequence[PhaseConfig],
        options: OptimizeOptions,
        *,
        progress=None,
        checkpoint: Callable[[dict], None] | None = None,
        checkpoint_every: int | None = None,
    ):
        self.fun = fun
        # starts batched together (`vmap_batch`); an objective without a
        # `group` has every start batched
        self.group = getattr(fun, "group", None)
        self.phases = tuple(phases)
        self.methods = [make_method(p) for p in self.phases]
        self.options = options
        self.progress = progress
        self.checkpoint = checkpoint
        self.checkpoint_every = checkpoint_every
        self._chunks: dict[Any, Callable] = {}  # chunk (p) and init (("init", p))

    # -- compiled pieces --------------------------------------------------------------
    def evaluate(self, xs, data):
        """Loss and gradient at every start `(start, n)`."""
        return self.fun.compiled("value_and_grad")(xs, data)

    def _init(self, p: int, x, f, g, data, *, abstract: bool = False):
        """`(state, f, g)` of phase `p` at every start (`abstract`: traced
        under `eval_shape`, without compiled calls).

        Every leaf comes back strongly typed, as the chunk function returns
        it: a weakly typed leaf (optax's zoom line search started its info
        from Python scalars) would make the chunk's second call a cache miss
        and compile the whole chunk again.
        """
        method = self.methods[p]

        def init(x, f, g):
            return _strong(method.init(x, f, g, self.fun, data))

        if abstract:
            return vmap_batch(init, group=self.group)(x, f, g)
        if isinstance(method, AbstractLeastSquaresMethod):
            r, J, *_ = self.fun.compiled("jacobian_and_solution")(x, data)
            return self._init_fn(p)(x, r, J)
        return self._init_fn(p)(x, f, g, data)

    def _init_fn(self, p: int):
        """Phase `p`'s method initialisation, compiled once per optimiser (a
        new `jit` at every call would compile it again on every run)."""
        key = ("init", p)
        if key not in self._chunks:
            method = self.methods[p]
            if isinstance(method, AbstractLeastSquaresMethod):

                def init(x, r, J):
                    return _strong(method.init_from_jacobian(x, r, J))

                fn = jit(vmap_batch(init, group=self.group))
            else:

                def init(x, f, g, data):
                    return _strong(method.init(x, f, g, self.fun, data))

                fn = jit(vmap_batch(init, in_axes=(0, 0, 0, None), group=self.group))
            self._chunks[key] = fn
        return self._chunks[key]

    def _chunk_fn(self, p: int):
        if p in self._chunks:
            return self._chunks[p]
        method: AbstractMethod = self.methods[p]
        fun = self.fun
        gtol, ftol, patience = _phase_settings(self.phases[p], self.options)
        max_retreats = self.options.max_retreats

        evaluates_start = method.evaluates_start

        def iterate(c: Carry, data) -> tuple[Carry, tuple]:
            kw = {"fresh": c.fresh} if evaluates_start else {}
            x, f, g, state, info = method.step(
                c.x, c.f, c.g, c.state, c.scale, fun, data, **kw
            )
            f_eval, g_eval, state_eval = f, g, state
            bad = info.nonfinite
            # a trip that is not an iteration (an L-BFGS backtracking trial)
            # leaves the iteration count and the patience as they were
            counted = jnp.asarray(info.counted)
            keep = lambda new, old: jnp.where(bad, old, new)  # noqa: E731
            x, f, g = keep(x, c.x), keep(f, c.f), keep(g, c.g)
            fallback = method.on_nonfinite(c.state, state, c.x)
            state = jax.tree.map(keep, state, fallback)
            scale = jnp.where(bad, 0.5 * c.scale, jnp.minimum(1.0, 2.0 * c.scale))
            n_bad = jnp.where(bad, c.n_bad + 1, 0)
            size = jnp.maximum(1.0, jnp.abs(f))
            flat = jnp.abs(c.f - f) <= ftol * size
            n_flat = jnp.where(
                bad | ~counted, c.n_flat, jnp.where(flat, c.n_flat + 1, 0)
            )
            gnorm = jnp.max(jnp.abs(g)) if g.size else jnp.zeros((), f.dtype)
            status = jnp.where(
                n_bad >= max_retreats,
                NONFINITE,
                jnp.where(
                    ~bad & (gnorm <= gtol * size),
                    GRADIENT,
                    jnp.where(
                        (n_flat >= patience) | info.stuck,
                        LOSS,
                        RUNNING,
                    ),
                ),
            ).astype(jnp.int32)
            step = jnp.sqrt(jnp.sum(jnp.square(x - c.x)))
            best = (c.best_x, c.best_f)
            it = c.iteration + counted.astype(c.iteration.dtype)
            new = Carry(
                x, f, g, state, scale, n_bad, n_flat, it, status, c.fresh, *best
            )
            if evaluates_start:
                # the first evaluation of a phase: the loss and gradient at x,
                # no step, no iteration counted; the method's state from them
                initial = Carry(
                    c.x,
                    f_eval,
                    g_eval,
                    state_eval,
                    c.scale,
                    c.n_bad,
                    c.n_flat,
                    c.iteration,
                    jnp.where(bad, NONFINITE, RUNNING).astype(jnp.int32),
                    jnp.zeros_like(c.fresh),
                    *best,
                )
                new = jax.tree.map(lambda a, b: jnp.where(c.fresh, a, b), initial, new)
            return _track_best(c, new), (f, gnorm, step)

        def run(c: Carry, data, n_end):
            start = c.iteration
            dt = c.f.dtype
            buf = (
                jnp.full((CAPACITY,), jnp.nan, dt),
                jnp.full((CAPACITY,), jnp.nan, dt),
                jnp.full((CAPACITY,), jnp.nan, dt),
            )

            def cond(s):
                c, _ = s
                return (c.status == RUNNING) & ((c.iteration < n_end) | c.fresh)

            def body(s):
                c, buf = s
                i = c.iteration - start
                c, rec = iterate(c, data)
                buf = tuple(b.at[i].set(v) for b, v in zip(buf, rec, strict=True))
                return c, buf

            return jax.lax.while_loop(cond, body, (c, buf))

        fn = jit(vmap_batch(run, in_axes=(0, None, None), group=self.group))
        self._chunks[p] = fn
        return fn

    # -- the host loop ---------------------------------------------------------------
    def start_phase(
        self,
        p: int,
        x,
        f,
        g,
        data,
        alive=None,
        *,
        abstract: bool = False,
        fresh: bool = False,
        best: tuple | None = None,
    ) -> Carry:
        """The carry at the start of phase `p`; `best`: the `(best_x, best_f)`
        of the phases before (default: the starting point, where its loss is
        finite). Built in NumPy (`abstract`: traced, in `jax.numpy`): setting
        up a phase compiles nothing but its method's initialisation."""
        xp = jnp if abstract else np
        n = x.shape[0]
        if fresh:  # evaluated by the phase's first chunk
            f = jax.device_put(np.full((n,), np.inf, x.dtype))
            g = jax.device_put(np.zeros(x.shape, x.dtype))
            alive = np.ones((n,), bool)
        state, f, g = self._init(p, x, f, g, data, abstract=abstract)
        if alive is None:
            alive = _finite(f, g)
        dt = x.dtype
        status = xp.where(xp.asarray(alive), RUNNING, NONFINITE).astype(np.int32)
        if best is None:
            f_ = f if abstract else np.asarray(f)
            best = (x, xp.where(xp.isfinite(f_), f_, np.inf).astype(f.dtype))
        # on the device: a chunk called with NumPy leaves and then with its own
        # (device) outputs would be traced and lowered twice (two cache entries)
        put = (lambda c: c) if abstract else jax.device_put
        return put(
            Carry(
                x,
                f,
                g,
                state,
                xp.ones((n,), dt),
                *(xp.zeros((n,), np.int32) for _ in range(3)),
                status,
                xp.full((n,), fresh),
                *best,
            )
        )

    def _next_phase(self, p: int, carry: Carry, data) -> Carry:
        """The carry at the start of phase `p` from the last phase's: the
        starts that failed there stay stopped, the best point seen carries on."""
        alive = np.asarray(carry.status) != NONFINITE
        best = (carry.best_x, carry.best_f)
        return self.start_phase(p, carry.x, carry.f, carry.g, data, alive, best=best)

    def template(self, p: int, xs, data) -> Carry:
        """The structure of a phase's carry (for restoring checkpoints)."""
        n = xs.shape[0]
        f = np.zeros((n,), xs.dtype)
        return jax.eval_shape(
            lambda x, f, g: self.start_phase(
                p, x, f, g, data, np.ones(n, bool), abstract=True
            ),
            xs,
            f,
            xs,
        )

    def run(self, xs, data, *, resume: dict | None = None) -> dict:
        """Optimise from starting points `xs (start, n)`.

        Returns `{"carry", "record", "stop_reason"}`: the final state of every
        start, the record (per-start histories of loss, gradient norm and step,
        the phase of each iteration, the status of every start at the end of
        every phase) and why the run stopped early (time budget, iteration
        cap), or None.
        """
        opts = self.options
        t0 = time.perf_counter()
        n_starts = xs.shape[0]
        if resume is None:
            first = self.methods[0]
            if first.evaluates_start:
                # the first chunk's executable evaluates the starting points
                carry = self.start_phase(0, xs, None, None, data, fresh=True)
                carry, _ = self._chunk_fn(0)(carry, data, np.int32(0))
            elif isinstance(first, AbstractLeastSquaresMethod):
                # its initialisation evaluates the residuals and Jacobian
                carry = self.start_phase(0, xs, None, None, data)
            else:
                f, g = self.evaluate(xs, data)
                carry = self.start_phase(0, xs, f, g, data)
            f_np = np.asarray(carry.f)
            if not (np.asarray(carry.status) == RUNNING).any():
                raise NonFiniteStartError(
                    "The loss or its gradient is not finite at every starting point "
                    f"(loss {f_np.tolist()}); check the initial parameter values "
                    "and the data."
                )
            rec = new_record(n_starts, f_np)
        else:
            rec, carry = resume["record"], resume["carry"]
        t_offset = rec["elapsed"]
        stop_reason = None
        chunk = opts.chunk_size or 2
        cap = opts.max_iterations
        every = self.checkpoint_every if self.checkpoint is not None else None
        for p in range(rec["phase"], len(self.phases)):
            phase = self.phases[p]
            if p != rec["phase"]:
                carry = self._next_phase(p, carry, data)
                rec["phase"], rec["phase_iteration"] = p, 0
            run_chunk = self._chunk_fn(p)
            if self.progress is not None:
                self.progress.phase(p, phase, rec)
            while True:
                remaining = phase.iterations - rec["phase_iteration"]
                if cap is not None:
                    remaining = min(remaining, cap - rec["iteration"])
                if remaining <= 0 or not (np.asarray(carry.status) == RUNNING).any():
                    break
                k = min(chunk, remaining, CAPACITY)
                if every:
                    k = min(k, every - rec["iteration"] % every)
                before = np.asarray(carry.iteration)
                t = time.perf_counter()
                n_end = np.int32(rec["phase_iteration"] + k)
                carry, buf = run_chunk(carry, data, n_end)
                counts = np.asarray(carry.iteration) - before
                seconds = time.perf_counter() - t
                done = int(counts.max())
                append_history(rec, buf, counts, p)
                rec["phase_iteration"] += done
                rec["iteration"] += done
                rec["elapsed"] = t_offset + time.perf_counter() - t0
                if opts.chunk_size is None and done:
                    per = seconds / done
                    chunk = int(np.clip(opts.target_seconds / per, 1, CAPACITY))
                if self.progress is not None:
                    self.progress.update(carry, rec)
                if every and rec["iteration"] % every == 0:
                    self.checkpoint(dict(carry=carry, record=rec))
                if opts.time_budget is not None and rec["elapsed"] >= opts.time_budget:
                    stop_reason = (
                        f"time budget of {opts.time_budget:g} s reached after "
                        f"{rec['iteration']} iterations"
                    )
                    if self.checkpoint is not None:
                        self.checkpoint(dict(carry=carry, record=rec))
                    break
            rec["statuses"].append(np.asarray(carry.status).tolist())
            if stop_reason is not None:
                break
            if cap is not None and rec["iteration"] >= cap:
                if p < len(self.phases) - 1:
                    stop_reason = (
                        f"iteration cap of {cap} reached in phase {p + 1} "
                        f"({phase.method})"
                    )
                break
        if stop_reason is None:
            rec["phase"] = len(self.phases)
        rec["elapsed"] = t_offset + time.perf_counter() - t0
        return dict(carry=carry, record=rec, stop_reason=stop_reason)


def _track_best(old: Carry, new: Carry) -> Carry:
    """`new` with the best point seen updated from its `(x, f)`."""
    improved = jnp.isfinite(new.f) & (new.f < old.best_f)
    return eqx.tree_at(
        lambda c: (c.best_x, c.best_f),
        new,
        (
            jnp.where(improved, new.x, old.best_x),
            jnp.where(improved, new.f, old.best_f),
        ),
    )


def _strong(tree):
    """`tree` with every leaf a strongly typed array of its own dtype."""

    def leaf(a):
        a = jnp.asarray(a)
        return a.astype(a.dtype)

    return jax.tree.map(leaf, tree)


def _finite(f, g):
    return np.isfinite(np.asarray(f)) & np.all(np.isfinite(np.asarray(g)), axis=1)
