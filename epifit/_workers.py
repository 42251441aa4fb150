"""The environment of a single-threaded JAX worker process."""

from __future__ import annotations

import os

__all__ = [
    "THREAD_VARS",
    "XLA_FLAGS",
    "cpu_cores",
    "single_threaded_env",
    "thread_workers",
]

# no multi-threaded Eigen and one intra-op thread per XLA CPU client, so that
# N workers use N cores, not N x N threads (epifit.batch.worker_env uses it too)
XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def single_threaded_env(cache_dir: str | os.PathLike | None = None) -> dict[str, str]:
    """XLA limited to one thread (the flags appended to any `XLA_FLAGS`
    already set), BLAS to one thread, and the shared compilation cache
    (`EPIFIT_CACHE_DIR`) when `cache_dir` is given."""
    flags = os.environ.get("XLA_FLAGS", "")
    env = {"XLA_FLAGS": f"{flags} {XLA_FLAGS}".strip()}
    env.update({k: "1" for k in THREAD_VARS})
    if cache_dir is not None:
        env["EPIFIT_CACHE_DIR"] = str(cache_dir)
    return env


def cpu_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS, Windows
        return os.cpu_count() or 1


def thread_workers() -> int:
    """How many threads a host-side split of one computation may use: the
    cores this process may run on, or one where XLA is limited to one thread
    (`single_threaded_env`: a worker of a batch, one of several on the
    machine)."""
    if "intra_op_parallelism_threads=1" in os.environ.get("XLA_FLAGS", ""):
        return 1
    return cpu_cores()
