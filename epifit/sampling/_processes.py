"""Chains in worker processes (`chain_method="processes"`).

`workers` processes, spawned (not forked: JAX is multithreaded and deadlocks
after a fork), each with XLA limited to one thread (`epifit._workers`) on the
CPU backend, and the persistent compilation cache of the parent when it has
one (`EPIFIT_CACHE_DIR`). Worker `w` runs chains `w, w + workers, ...` one
after another with `run_chain`, from the pickled log density (a model, its
data and the fit's objective: plain data; nothing compiled crosses a process
boundary, each worker compiles its own program). After each chunk it sends
the chain's progress, and its snapshot when the run is checkpointed, to the
parent, which alone writes the checkpoint file and draws the progress bars;
then each chain's result. A worker's exception is raised again in the parent
(its type kept where it pickles); a worker that dies (killed, out of memory)
is a `RuntimeError` naming its chains.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import queue

import numpy as np

from epifit._workers import single_threaded_env

__all__ = ["run_processes"]

POLL_S = 1.0  # how often the parent looks for a dead worker
JAX_SETTINGS = ("jax_enable_x64", "jax_numpy_rank_promotion")


def run_processes(density, settings, starts, imm0, anchor, store, bar, workers: int):
    """Every chain in `workers` spawned processes; the results in chain order,
    as `run_chain` returns them (`warmup_s` includes the worker's compiles)."""
    import jax

    ctx = multiprocessing.get_context("spawn")
    messages = ctx.Queue()
    config = {
        "jax": {k: getattr(jax.config, k) for k in JAX_SETTINGS},
        "cache_dir": _cache_dir(),
    }
    job = pickle.dumps(
        (density, settings, np.asarray(starts), np.asarray(imm0), np.asarray(anchor))
    )
    groups = [list(range(w, settings.chains, workers)) for w in range(workers)]
    env = single_threaded_env(config["cache_dir"]) | {"JAX_PLATFORMS": "cpu"}
    procs, results = [], {}
    try:
        with _environ(env):  # a spawned child inherits the environment
            for g in groups:
                saved = {c: store.saved(c) for c in g}
                p = ctx.Process(
                    target=_worker,
                    args=(g, config, job, saved, store.enabled, messages),
                    name=f"epifit-chains-{'-'.join(map(str, g))}",
                    daemon=True,
                )
                p.start()
                procs.append(p)
        while len(results) < settings.chains:
            try:
                kind, c, *rest = messages.get(timeout=POLL_S)
            except queue.Empty:
                _check_workers(procs, groups, results)
                continue
            if kind == "chunk":
                (flat,) = rest
                if flat is not None:
                    store.save_flat(c, flat)
            elif kind == "progress":
                bar(c, rest[0])
            elif kind == "result":
                results[c] = rest[0]
            else:
                raise _worker_error(c, *rest)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join()
        messages.close()
    return [results[c] for c in range(settings.chains)]


def _cache_dir() -> str | None:
    """The parent's persistent compilation cache, if it uses one."""
    import jax

    if os.environ.get("EPIFIT_NO_CACHE") is not None:
        return None
    return jax.config.jax_compilation_cache_dir or None


@contextlib.contextmanager
def _environ(env: dict[str, str]):
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _check_workers(procs, groups, results) -> None:
    """Raise if a worker died, or all ended with chains unreported."""
    for p, g in zip(procs, groups, strict=True):
        if p.exitcode not in (None, 0):
            raise RuntimeError(
                f"the worker process of chains {g} died (exit code {p.exitcode}; "
                "killed or out of memory?); chain_method='sequential' runs the "
                "chains in this process"
            )
    if all(p.exitcode == 0 for p in procs):
        missing = [c for g in groups for c in g if c not in results]
        raise RuntimeError(f"the worker processes ended without chains {missing}")


def _worker_error(chain: int, pickled: bytes | None, text: str) -> BaseException:
    err = None
    if pickled is not None:
        with contextlib.suppress(Exception):
            err = pickle.loads(pickled)
    if not isinstance(err, BaseException):
        err = RuntimeError(text)
    err.add_note(f"(in the worker process of chain {chain})")
    return err


def _worker(chains, config, job, saved, checkpointed, messages) -> None:
    """A worker process: its chains one after another (see the module)."""
    chain = chains[0]
    try:
        import jax
        import jax.numpy as jnp

        for k, v in config["jax"].items():
            jax.config.update(k, v)
        if config["cache_dir"] is not None:
            from epifit._cache import enable_compilation_cache

            enable_compilation_cache(config["cache_dir"])
        from epifit.sampling._checkpoint import flatten, unflatten
        from epifit.sampling._nuts import Programs, run_chain

        density, settings, starts, imm0, anchor = pickle.loads(job)
        programs = Programs(density, settings, anchor)
        data = density.objective.data()
        imm0 = jnp.asarray(imm0)
        for chain in chains:

            def on_chunk(snap, c=chain):
                if checkpointed:
                    messages.put(("chunk", c, flatten(snap)))

            def on_progress(done, c=chain):
                messages.put(("progress", c, done))

            flat = saved.get(chain)
            resume = None if flat is None else unflatten(chain, flat)
            result = run_chain(programs, chain, starts[chain], imm0, data,
                               resume=resume, on_chunk=on_chunk,
                               on_progress=on_progress)  # fmt: skip
            messages.put(("result", chain, result))
    except KeyboardInterrupt:  # the parent's too: it stops the run
        return
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        try:
            pickled = pickle.dumps(err)
            pickle.loads(pickled)
        except Exception:  # noqa: BLE001 - not picklable: its text only
            pickled = None
        text = f"{type(err).__name__}: {err}"
        messages.put(("error", chain, pickled, text))
