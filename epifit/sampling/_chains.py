"""How the chains run (`chain_method`): one after another, vmapped in one
program, or in spawned worker processes (`_processes.py`).

Whatever the method, chain `c` runs the same transitions from the same keys
(`_nuts.py`), so its draws do not depend on the method (to float64 rounding:
see README.md), and a checkpoint written by one method resumes under another.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from epifit._workers import cpu_cores
from epifit.sampling._nuts import (
    Programs,
    chain_result,
    draw_keys,
    extended,
    new_snapshot,
    run_chain,
    total_draws,
    warmup_key,
)

__all__ = ["CHAIN_METHODS", "resolve_chain_method", "run_sequential", "run_vectorized"]

CHAIN_METHODS = ("sequential", "vectorized", "processes")


def resolve_chain_method(
    method: str | None, workers: int | None, chains: int
) -> tuple[str, int]:
    """The method (None: `vectorized` on a GPU or TPU backend, `sequential`
    on CPU) and the number of worker processes (`processes` only; default one
    per core, at most one per chain).

    Raises:
        ValueError: an unknown method; `workers` without `processes`, or not
            a positive int.
    """
    if method is None:
        method = "sequential" if jax.default_backend() == "cpu" else "vectorized"
    if method not in CHAIN_METHODS:
        raise ValueError(f"chain_method must be one of {CHAIN_METHODS}; got {method!r}")
    if workers is not None:
        if method != "processes":
            raise ValueError(
                f"workers is for chain_method='processes'; got chain_method={method!r}"
            )
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be an int >= 1; got {workers!r}")
    if method != "processes":
        return method, 1
    return method, min(chains, workers if workers is not None else cpu_cores())


def run_sequential(programs: Programs, starts, imm0, data, store, bar) -> list[dict]:
    """Every chain, one after another, saved by `store` after each chunk and
    shown by `bar(chain, draws_done)`."""
    results = []
    for c in range(programs.settings.chains):

        def on_chunk(snap, c=c):
            store.save(snap)
            bar(c, snap["done"])

        resume = store.load(c)
        results.append(
            run_chain(
                programs, c, starts[c], imm0, data, resume=resume, on_chunk=on_chunk
            )  # fmt: skip
        )
    return results


def _row(tree, i: int):
    return jax.tree.map(lambda a: a[i], tree)


def _stack(trees):
    return jax.tree.map(lambda *a: jnp.stack(a), *trees)


def run_vectorized(programs: Programs, starts, imm0, data, store, bar) -> list[dict]:
    """Every chain in one vmapped program: the warm-ups of the chains not yet
    warmed up, then chunk after chunk of the chains furthest behind (all of
    them, unless a checkpoint left them at different draws), saved by `store`
    after each. Every chain reports the same `warmup_s` and `draws_s`."""
    s = programs.settings
    t0 = time.perf_counter()
    snaps = {c: store.load(c) for c in range(s.chains)}
    fresh = [c for c in range(s.chains) if snaps[c] is None]
    if fresh:
        x0 = jnp.asarray(np.asarray(starts)[fresh])
        if s.warmup:
            keys = jnp.stack([warmup_key(s.seed, c) for c in fresh])
            state, step, imm = programs.warm_chains(keys, x0, imm0, data)
        else:
            state = programs.init_chains(x0, data)
            step = jnp.ones(len(fresh), x0.dtype)
            imm = jnp.broadcast_to(imm0, (len(fresh), *jnp.shape(imm0)))
        jax.block_until_ready(state)
        for i, c in enumerate(fresh):
            snaps[c] = new_snapshot(c, _row(state, i), step[i], imm[i])
            bar(c, 0)
        store.save(*(snaps[c] for c in fresh))
    t1 = time.perf_counter()
    while behind := [c for c in snaps if snaps[c]["done"] < total_draws(s)]:
        done = min(snaps[c]["done"] for c in behind)
        group = [c for c in behind if snaps[c]["done"] == done]
        state, (pos, stats) = programs.chunk_chains(
            _stack([snaps[c]["state"] for c in group]),
            jnp.stack([draw_keys(s.seed, c, done, s.chunk) for c in group]),
            jnp.stack([snaps[c]["step_size"] for c in group]),
            jnp.stack([snaps[c]["inverse_mass_matrix"] for c in group]),
            data,
        )
        pos, stats = np.asarray(pos), [np.asarray(v) for v in stats]
        for i, c in enumerate(group):
            snaps[c] = extended(
                snaps[c], _row(state, i), pos[i], [v[i] for v in stats], s.chunk
            )
            bar(c, snaps[c]["done"])
        store.save(*(snaps[c] for c in group))
    t2 = time.perf_counter()
    return [chain_result(snaps[c], s, t1 - t0, t2 - t1) for c in range(s.chains)]
