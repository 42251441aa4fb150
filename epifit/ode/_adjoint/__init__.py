from .base import AbstractAdjoint as AbstractAdjoint
from .checkpoint import CheckpointAdjoint as CheckpointAdjoint
