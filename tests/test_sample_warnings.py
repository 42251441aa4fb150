"""`Posterior.warnings` on the geometry of a posterior: transitions that
reached the maximum tree depth, and chains started at a saddle of the log
posterior (a MAP whose Laplace approximation fell back). Built on small
InferenceData objects: no sampling."""

import arviz as az
import numpy as np
import pytest

from epifit.fitting._fallback import FALLBACK, is_fallback
from epifit.sampling import Posterior


def _posterior(depths, **attrs) -> Posterior:
    rng = np.random.default_rng(0)
    depths = np.asarray(depths)
    idata = az.from_dict(
        posterior={"a": rng.standard_normal((4, 1000))},
        sample_stats={
            "tree_depth": np.broadcast_to(depths, (4, 1000)).copy(),
            "diverging": np.zeros((4, 1000), bool),
        },
    )
    idata.posterior.attrs.update(attrs)
    return Posterior(idata)


def test_well_behaved_chains_give_no_geometry_warning():
    post = _posterior(3, max_tree_depth=10, map_saddle="False")
    assert post.warnings() == []


def test_transitions_at_the_maximum_tree_depth_are_counted():
    depths = np.where(np.arange(1000) % 4 == 0, 10, 4)  # a quarter at the limit
    warns = _posterior(depths, max_tree_depth=10).warnings()
    assert len(warns) == 1, warns
    assert warns[0].startswith(
        "1000 of 4000 transition(s) reached the maximum tree depth 10"
    )
    # below the limit: nothing
    assert _posterior(depths, max_tree_depth=11).warnings() == []


def test_a_start_at_a_saddle_is_said():
    warns = _posterior(3, max_tree_depth=10, map_saddle="True").warnings()
    assert len(warns) == 1 and "negative curvature" in warns[0], warns
    assert "conditional posterior" in warns[0]


@pytest.mark.parametrize(
    "message, want",
    [
        ("", False),
        (
            "2 direction(s) without curvature; infinite standard errors",
            False,
        ),
        (f"the Hessian ... is not positive definite: ...; {FALLBACK}", True),
    ],
)
def test_a_fits_message_tells_the_fallback(message, want):
    assert is_fallback(message) is want
