"""Test configuration: float64, strict rank promotion, the reference problem."""

import jax
import pytest

jax.config.update("jax_enable_x64", True)
# catches silent (patch,) x (stage, patch) broadcasting
jax.config.update("jax_numpy_rank_promotion", "raise")

import helpers  # noqa: E402  (after the config, so helpers see x64)


@pytest.fixture(scope="session")
def reference_problem():
    """The reference problem's module, `benchmarks/reference/problem.py`."""
    return helpers.reference_problem()
