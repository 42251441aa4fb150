from ._common import forward_mode as forward_mode
from .base import AbstractAdjoint as AbstractAdjoint
from .checkpoint import CheckpointAdjoint as CheckpointAdjoint
from .continuous import BacksolveAdjoint as BacksolveAdjoint
from .continuous import InterpolatingAdjoint as InterpolatingAdjoint
from .continuous import QuadratureAdjoint as QuadratureAdjoint
from .forward import ForwardAdjoint as ForwardAdjoint
