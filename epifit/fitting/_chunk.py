"""The compiled chunk of the optimiser loop (`_optimize.Optimizer`): up to
`k` iterations of one program's phases in a `lax.while_loop`, the history of
each iteration in fixed buffers.

A program is the phases that share one executable: every phase of a trial
method (`TrialMethod`: first-order, L-BFGS) in one, each other phase in its
own. The phase is the chunk's argument `j`; for trial methods a trip is the
phase's `propose` (a `lax.switch`), one `value_and_grad`, the phase's
`accept` (a second switch), so the executable holds one copy of the
gradient whatever the number of phases. The carry holds the method state of
every phase of its program (a phase's slot is zeros until it starts).
"""

from __future__ import annotations

from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp

from epifit._stored import stored
from epifit._vmap import vmap_batch
from epifit.fitting._methods import AbstractMethod, TrialMethod

__all__ = [
    "CAPACITY",
    "GRADIENT",
    "LOSS",
    "NONFINITE",
    "RUNNING",
    "STATUS",
    "Carry",
    "make_chunk",
    "put_state",
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
    # one method state per phase of the program (`Optimizer.members`); a
    # phase's slot holds zeros until the phase starts
    state: tuple
    scale: jax.Array  # retreat factor applied to steps (1 = full steps)
    n_bad: jax.Array  # consecutive rejected steps
    n_flat: jax.Array  # consecutive iterations with a small loss change
    iteration: jax.Array  # iterations done in this phase
    status: jax.Array
    fresh: jax.Array  # (`evaluates_start` methods) not evaluated yet: evaluate, no step
    best_x: jax.Array  # the point of the lowest finite loss seen (all phases)
    best_f: jax.Array  # that loss (inf before the first finite one)


def make_chunk(
    methods: Sequence[AbstractMethod],
    settings: Sequence[tuple],
    fun,
    max_retreats: int,
    group,
):
    """The jitted chunk `(carry, data, n_end, j) -> (carry, history buffers)`
    of a program whose phases have `methods` and `(gtol, ftol, patience)`
    `settings`; `group`: how many starts to batch (`vmap_batch`)."""
    evaluates_start = methods[0].evaluates_start

    def iterate(c: Carry, data, j) -> tuple[Carry, tuple]:
        x, f, g, state, info = _trip(methods, fun, c, data, j)
        gtol, ftol, patience = _select(settings, j, c.f.dtype)
        f_eval, g_eval, state_eval = f, g, state
        bad = info.nonfinite
        # a trip that is not an iteration (an L-BFGS backtracking trial)
        # leaves the iteration count and the patience as they were
        counted = jnp.asarray(info.counted)
        keep = lambda new, old: jnp.where(bad, old, new)  # noqa: E731
        x, f, g = keep(x, c.x), keep(f, c.f), keep(g, c.g)
        # (the other phases' slots: old and new are the same)
        fallback = tuple(
            m.on_nonfinite(old, new, c.x)
            for m, old, new in zip(methods, c.state, state, strict=True)
        )
        state = jax.tree.map(keep, state, fallback)
        scale = jnp.where(bad, 0.5 * c.scale, jnp.minimum(1.0, 2.0 * c.scale))
        n_bad = jnp.where(bad, c.n_bad + 1, 0)
        size = jnp.maximum(1.0, jnp.abs(f))
        flat = jnp.abs(c.f - f) <= ftol * size
        n_flat = jnp.where(bad | ~counted, c.n_flat, jnp.where(flat, c.n_flat + 1, 0))
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
        new = Carry(x, f, g, state, scale, n_bad, n_flat, it, status, c.fresh, *best)
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

    def run(c: Carry, data, n_end, j):
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
            c, rec = iterate(c, data, j)
            buf = tuple(b.at[i].set(v) for b, v in zip(buf, rec, strict=True))
            return c, buf

        return jax.lax.while_loop(cond, body, (c, buf))

    # jitted, and kept across CLI runs with the same inputs (`epifit._stored`);
    # the output is the carry's structure and the three history buffers
    return stored(
        f"chunk {methods!r} {settings!r} {max_retreats} {group}",
        vmap_batch(run, in_axes=(0, None, None, None), group=group),
        out_tree=lambda c, *_: jax.tree.structure((c, (0, 0, 0))),
    )


def _trip(methods: Sequence[AbstractMethod], fun, c: Carry, data, j):
    """One trip of phase `j`: for trial methods, the phase's trial
    point, the one evaluation, the phase's update."""
    if not isinstance(methods[0], TrialMethod):
        (method,) = methods
        *out, info = method.step(c.x, c.f, c.g, c.state[0], c.scale, fun, data)
        return (*out[:3], (out[3],), info)

    def propose(i):
        def branch():
            m = methods[i]
            x_t, s = m.propose(c.x, c.f, c.g, c.state[i], c.scale, c.fresh)
            return x_t, put_state(c.state, i, _like(s, c.state[i]))

        return branch

    x_t, states = _switch(j, [propose(i) for i in range(len(methods))])
    f_t, g_t = fun.value_and_grad(x_t, data)

    def accept(i):
        def branch():
            m = methods[i]
            *out, info = m.accept(
                c.x, c.f, c.g, states[i], c.scale, c.fresh, x_t, f_t, g_t
            )
            return (*out[:3], put_state(states, i, _like(out[3], states[i])), info)

        return branch

    return _switch(j, [accept(i) for i in range(len(methods))])


def put_state(states: tuple, i: int, state) -> tuple:
    """`states` with slot `i` replaced by `state`."""
    return (*states[:i], state, *states[i + 1 :])


def _like(tree, ref):
    """`tree` cast to the dtypes of `ref`, strongly typed (the branches of
    the program's `lax.switch` agree on every leaf)."""
    return jax.tree.map(lambda a, r: jnp.asarray(a).astype(r.dtype), tree, ref)


def _switch(j, branches):
    """`branches[j]()`, as a `lax.switch` when there is more than one."""
    if len(branches) == 1:
        return branches[0]()
    return jax.lax.switch(j, branches)


def _select(settings: list[tuple], j, dtype) -> tuple:
    """Phase `j`'s `(gtol, ftol, patience)`: Python numbers for a program of
    one phase, else picked from arrays by the traced `j`."""
    if len(settings) == 1:
        return settings[0]
    gtol, ftol, patience = zip(*settings, strict=True)
    return (
        jnp.asarray(gtol, dtype)[j],
        jnp.asarray(ftol, dtype)[j],
        jnp.asarray(patience, jnp.int32)[j],
    )


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
