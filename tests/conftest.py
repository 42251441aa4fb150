"""Test configuration: float64, strict rank promotion, the reference module."""

import jax
import pytest

jax.config.update("jax_enable_x64", True)
# catches silent (patch,) x (stage, patch) broadcasting
jax.config.update("jax_numpy_rank_promotion", "raise")

import helpers  # noqa: E402  (after the config, so helpers see x64)


@pytest.fixture(scope="session")
def seed_metapop():
    """The reference module `../shared/bench/seed_metapop.py` (skips if absent)."""
    return helpers.import_reference()
