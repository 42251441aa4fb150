"""How the chains run (`chain_method`): one after another, in threads of
this process, vmapped in one program, or in spawned worker processes
(`_processes.py`).

Whatever the method, chain `c` runs the same transitions from the same keys
(`_nuts.py`), so its draws do not depend on the method (to float64 rounding:
see README.md), and a checkpoint written by one method resumes under another.
"""

from __future__ import annotations

import functools
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from epifit._workers import cpu_cores
from epifit.sampling._nuts import (
    Programs,
    advanced,
    chain_result,
    check_begun,
    run_chain,
    total_draws,
    transitions,
)

__all__ = [
    "CHAIN_METHODS",
    "resolve_chain_method",
    "run_sequential",
    "run_threads",
    "run_vectorized",
]

CHAIN_METHODS = ("sequential", "threads", "vectorized", "processes")
POOLED = ("threads", "processes")  # the methods that take `workers`


def resolve_chain_method(
    method: str | None, workers: int | None, chains: int
) -> tuple[str, int]:
    """The method (None: `vectorized` on a GPU or TPU backend; on CPU
    `threads` with more than one core and chain, else `sequential`) and the
    number of workers (threads or processes; default one per core, at most
    one per chain; 1 for the other methods).

    Raises:
        ValueError: an unknown method; `workers` without `threads` or
            `processes`, or not a positive int.
    """
    if method is None:
        several = cpu_cores() > 1 and chains > 1
        method = "threads" if several else "sequential"
        method = method if jax.default_backend() == "cpu" else "vectorized"
    if method not in CHAIN_METHODS:
        raise ValueError(f"chain_method must be one of {CHAIN_METHODS}; got {method!r}")
    if workers is not None:
        if method not in POOLED:
            raise ValueError(
                "workers is for chain_method='threads' or 'processes'; got "
                f"chain_method={method!r}"
            )
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be an int >= 1; got {workers!r}")
    if method not in POOLED:
        return method, 1
    return method, min(chains, workers if workers is not None else cpu_cores())


def run_sequential(programs: Programs, starts, imm0, data, store, bar) -> list[dict]:
    """Every chain, one after another, saved by `store` after each chunk and
    shown by `bar(chain, transitions_done)`."""
    results = []
    for c in range(programs.settings.chains):
        results.append(
            run_chain(programs, c, starts[c], imm0, data, resume=store.load(c),
                      on_chunk=store.save, on_progress=functools.partial(bar, c))
        )  # fmt: skip
    return results


class _Stopped(Exception):
    """Another chain's thread failed or was interrupted: stop this one."""


def run_threads(
    programs: Programs, starts, imm0, data, store, bar, workers: int
) -> list[dict]:
    """Every chain as `run_sequential` runs it (the same draws, bit for
    bit), `workers` chains at a time in threads of this process: XLA runs a
    compiled program without Python's lock, so on a CPU two threads keep two
    cores busy with a program that mostly runs on one (loops of small
    operations). The program is compiled first, by a chunk of a chain's
    transitions whose result is dropped, so that no two threads compile it;
    that time is counted in the first chain's `warmup_s`. A failure or an
    interruption stops every chain at its next chunk (what was saved stays
    saved)."""
    s = programs.settings
    t0 = time.perf_counter()
    resumes = {c: store.load(c) for c in range(s.chains)}
    todo = [c for c, r in resumes.items() if r is None or r["done"] < total_draws(s)]
    if todo:  # compile once, here
        c = todo[0]
        first = programs.steps(programs.fresh(starts[c], imm0), c, 0, data)
        check_begun(first[0])
    compile_s = time.perf_counter() - t0
    lock, stop = threading.Lock(), threading.Event()

    def chain(c: int) -> dict:
        def on_chunk(snap):
            with lock:
                store.save(snap)

        def on_progress(done):
            if stop.is_set():
                raise _Stopped
            with lock:
                bar(c, done)

        return run_chain(programs, c, starts[c], imm0, data, resume=resumes[c],
                         on_chunk=on_chunk, on_progress=on_progress)  # fmt: skip

    pool = ThreadPoolExecutor(workers, thread_name_prefix="epifit-chain")
    try:
        results = [f.result() for f in [pool.submit(chain, c) for c in range(s.chains)]]
    except BaseException:
        stop.set()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    results[0]["warmup_s"] += compile_s
    return results


def _row(tree, i: int):
    return jax.tree.map(lambda a: a[i], tree)


def _stack(trees):
    return jax.tree.map(lambda *a: jnp.stack(a), *trees)


def run_vectorized(programs: Programs, starts, imm0, data, store, bar) -> list[dict]:
    """Every chain in one vmapped program: chunk after chunk of the chains
    furthest behind (all of them, unless a checkpoint left them apart),
    saved by `store` after each chunk past their warm-up. Every chain reports
    the same `warmup_s` and `draws_s`."""
    s = programs.settings
    t0 = t1 = time.perf_counter()
    snaps = {c: store.load(c) for c in range(s.chains)}
    carries = {
        c: programs.fresh(starts[c], imm0) if snap is None else programs.resumed(snap)
        for c, snap in snaps.items()
    }
    at = {c: 0 if v is None else s.warmup + v["done"] for c, v in snaps.items()}
    while behind := [c for c in at if at[c] < transitions(s)]:
        start = min(at[c] for c in behind)
        group = [c for c in behind if at[c] == start]
        chains = np.asarray(group, np.int32)
        stacked = _stack([carries[c] for c in group])
        carry, out = programs.steps_chains(stacked, chains, start, data)
        if start == 0:
            check_begun(carry)
        out = jax.tree.map(np.asarray, out)
        for i, c in enumerate(group):
            carries[c] = _row(carry, i)
            new = advanced(snaps[c], c, carries[c], start, _row(out, i), s)
            at[c] = start + s.chunk
            if new is not None and snaps[c] is None:
                t1 = time.perf_counter()
            snaps[c] = new if new is not None else snaps[c]
        for c in group:
            bar(c, at[c])
        store.save(*(snaps[c] for c in group if snaps[c] is not None))
    t2 = time.perf_counter()
    return [chain_result(snaps[c], s, t1 - t0, t2 - t1) for c in range(s.chains)]
