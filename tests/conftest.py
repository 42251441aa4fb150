"""Test configuration: float64, strict rank promotion, one compilation cache
for the session, the reference problem."""

import os
import shutil
import tempfile

import jax
import pytest

jax.config.update("jax_enable_x64", True)
# catches silent (patch,) x (stage, patch) broadcasting
jax.config.update("jax_numpy_rank_promotion", "raise")

# One persistent compilation cache for the whole session: many files compile
# the same programs (the boarding-school SIR fit, ...) in fresh closures, and
# the xdist workers and the subprocesses (CLI runs, benchmarks, notebook
# kernels, batch workers) each compile them again. The first process to load
# this file (the xdist controller, or a plain pytest run) makes the folder and
# hands it on in the environment; it deletes it at the end. A cached
# executable is the one XLA compiled for the same program, so no result
# changes. EPIFIT_TEST_JAX_CACHE=0 turns the cache off; a folder given there
# is used and kept.
CACHE_VAR = "EPIFIT_TEST_JAX_CACHE"
_OWN_CACHE = None
if os.environ.get(CACHE_VAR) != "0":
    if not os.environ.get(CACHE_VAR):
        _OWN_CACHE = tempfile.mkdtemp(prefix="epifit-test-jax-")
        os.environ[CACHE_VAR] = _OWN_CACHE
    from epifit._cache import enable_compilation_cache

    _cache = str(enable_compilation_cache(os.environ[CACHE_VAR]))
    # `epifit.cli.main`, batch workers and subprocesses use the same folder
    os.environ["EPIFIT_CACHE_DIR"] = _cache
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = str(
        jax.config.jax_persistent_cache_min_compile_time_secs
    )
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import helpers  # noqa: E402  (after the config, so helpers see x64)


def pytest_unconfigure(config):
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


@pytest.fixture(scope="session")
def reference_problem():
    """The reference problem's module, `benchmarks/reference/problem.py`."""
    return helpers.reference_problem()
