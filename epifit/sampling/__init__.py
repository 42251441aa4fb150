"""Posterior sampling: NUTS (blackjax) over a fit's free parameters, on the
same log posterior as `calibrate`, written as ArviZ data (see README.md)."""

from epifit.sampling._checkpoint import SamplerCheckpointError as SamplerCheckpointError
from epifit.sampling._density import LogDensity as LogDensity
from epifit.sampling._posterior import Posterior as Posterior
from epifit.sampling._sample import sample as sample

__all__ = ["LogDensity", "Posterior", "SamplerCheckpointError", "sample"]
