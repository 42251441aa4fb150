"""The optimiser loop: phases of methods, run jitted in chunks of iterations.

A compiled chunk runs up to `k` iterations of a phase's method inside a
`lax.while_loop` (for every start: one after another on CPU, batched by
`vmap` elsewhere; see `epifit._vmap.default_group`) and records the loss,
gradient norm and step of each iteration. Every phase of a trial method
(first-order, L-BFGS: `TrialMethod`) runs in one program: the phase is an
argument, a `lax.switch` picks its trial point and its update, and the one
`value_and_grad` between them is shared, so that a fit of Adam then L-BFGS
compiles its objective's gradient once. The carry holds the state of every
phase of its program. A Levenberg-Marquardt phase has a program of its own.
Between chunks the host updates the progress bar, writes checkpoints and
checks the time budget. Chunk sizes adapt to the cost of an iteration (about
one chunk per `target_seconds`) but never change the numbers: an iteration
is the same compiled computation whichever chunk it falls in, so a run
resumed from a checkpoint reproduces an uninterrupted one exactly.

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

import jax
import jax.numpy as jnp
import numpy as np

from epifit._jit import jit
from epifit._vmap import vmap_batch
from epifit.fitting._chunk import (
    CAPACITY,
    NONFINITE,
    RUNNING,
    Carry,
    make_chunk,
    put_state,
)
from epifit.fitting._config import PhaseConfig
from epifit.fitting._diagnose import NonFiniteStartError
from epifit.fitting._methods import (
    AbstractLeastSquaresMethod,
    TrialMethod,
    make_method,
)
from epifit.fitting._record import append_history, new_record

__all__ = [
    "Carry",
    "NonFiniteStartError",
    "OptimizeOptions",
    "Optimizer",
]


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
        # the phases of each compiled program: every trial-method phase in
        # one, each other phase in its own; `slot[p]`: (program, index)
        self.members: dict[Any, list[int]] = {}
        self.slot: dict[int, tuple[Any, int]] = {}
        for p, method in enumerate(self.methods):
            key = "trial" if isinstance(method, TrialMethod) else p
            self.slot[p] = (key, len(self.members.setdefault(key, [])))
            self.members[key].append(p)
        self.options = options
        self.progress = progress
        self.checkpoint = checkpoint
        self.checkpoint_every = checkpoint_every
        # chunk (program key) and initialisation (("init", p))
        self._chunks: dict[Any, Callable] = {}

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
        """The compiled chunk of phase `p`'s program: `(carry, data, n_end,
        j)`, `j` the phase's index among the program's (`slot[p][1]`)."""
        key = self.slot[p][0]
        if key not in self._chunks:
            phases = self.members[key]
            self._chunks[key] = make_chunk(
                [self.methods[q] for q in phases],
                [_phase_settings(self.phases[q], self.options) for q in phases],
                self.fun,
                self.options.max_retreats,
                self.group,
            )
        return self._chunks[key]

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
        states: tuple | None = None,
    ) -> Carry:
        """The carry at the start of phase `p`; `best`: the `(best_x, best_f)`
        of the phases before (default: the starting point, where its loss is
        finite); `states`: the program's method states from the phase before
        when it ran in the same program (default: zeros). Built in NumPy
        (`abstract`: traced, in `jax.numpy`): setting up a phase compiles
        nothing but its method's initialisation."""
        xp = jnp if abstract else np
        n = x.shape[0]
        if fresh:  # evaluated by the phase's first chunk
            f = jax.device_put(np.full((n,), np.inf, x.dtype))
            g = jax.device_put(np.zeros(x.shape, x.dtype))
            alive = np.ones((n,), bool)
        key, j = self.slot[p]
        if states is None:
            states = tuple(
                None if i == j else self._blank(q, x, data, abstract)
                for i, q in enumerate(self.members[key])
            )
        state, f, g = self._init(p, x, f, g, data, abstract=abstract)
        state = put_state(states, j, state)
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

    def _blank(self, q: int, x, data, abstract: bool):
        """Zeros in the structure of phase `q`'s method state (its slot in
        the program's carry before the phase starts)."""
        n = x.shape[0]
        f, g = np.zeros((n,), x.dtype), np.zeros(x.shape, x.dtype)
        shapes = jax.eval_shape(
            lambda x: self._init(q, x, f, g, data, abstract=True)[0], x
        )
        xp = jnp if abstract else np
        return jax.tree.map(lambda s: xp.zeros(s.shape, s.dtype), shapes)

    def _next_phase(self, p: int, carry: Carry, data) -> Carry:
        """The carry at the start of phase `p` from the last phase's: the
        starts that failed there stay stopped, the best point seen carries on,
        and so do the method states when both phases run in one program."""
        alive = np.asarray(carry.status) != NONFINITE
        best = (carry.best_x, carry.best_f)
        same = self.slot[p][0] == self.slot[p - 1][0]
        return self.start_phase(
            p,
            carry.x,
            carry.f,
            carry.g,
            data,
            alive,
            best=best,
            states=carry.state if same else None,
        )

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

    def first_carry(self, xs, data) -> Carry:
        """The carry of the first phase at starting points `xs`, evaluated
        (the loss, its gradient and the method's state at every start; a
        start whose loss or gradient is not finite has loss `inf` or NaN and
        is marked `NONFINITE`), by a program the run compiles anyway: the
        first chunk for a method that evaluates its start, the method's
        initialisation for least squares, else `value_and_grad`. `run(xs,
        data, first=...)` goes on from it without evaluating the starts
        again, so a caller that screens its starts (`finite_starts`)
        compiles no program of its own for it."""
        first = self.methods[0]
        if first.evaluates_start:
            # the first chunk's executable evaluates the starting points
            carry = self.start_phase(0, xs, None, None, data, fresh=True)
            j = np.int32(self.slot[0][1])
            return self._chunk_fn(0)(carry, data, np.int32(0), j)[0]
        if isinstance(first, AbstractLeastSquaresMethod):
            # its initialisation evaluates the residuals and Jacobian
            return self.start_phase(0, xs, None, None, data)
        f, g = self.evaluate(xs, data)
        return self.start_phase(0, xs, f, g, data)

    def run(
        self, xs, data, *, resume: dict | None = None, first: Carry | None = None
    ) -> dict:
        """Optimise from starting points `xs (start, n)` (`first`: their
        evaluated carry, from [`first_carry`][] at the same `xs`).

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
            carry = self.first_carry(xs, data) if first is None else first
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
            j = np.int32(self.slot[p][1])
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
                carry, buf = run_chunk(carry, data, n_end, j)
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


def _strong(tree):
    """`tree` with every leaf a strongly typed array of its own dtype."""

    def leaf(a):
        a = jnp.asarray(a)
        return a.astype(a.dtype)

    return jax.tree.map(leaf, tree)


def _finite(f, g):
    return np.isfinite(np.asarray(f)) & np.all(np.isfinite(np.asarray(g)), axis=1)
