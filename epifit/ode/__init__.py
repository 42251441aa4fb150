"""The ODE core: segment-wise integration of pytree vector fields.

It knows nothing of epidemics. See `epifit/ode/README.md` for the contracts.
"""

from ._adjoint import AbstractAdjoint as AbstractAdjoint
from ._adjoint import BacksolveAdjoint as BacksolveAdjoint
from ._adjoint import CheckpointAdjoint as CheckpointAdjoint
from ._adjoint import ForwardAdjoint as ForwardAdjoint
from ._adjoint import InterpolatingAdjoint as InterpolatingAdjoint
from ._adjoint import QuadratureAdjoint as QuadratureAdjoint
from ._adjoint import forward_mode as forward_mode
from ._errors import Result as Result
from ._errors import SolverError as SolverError
from ._errors import raise_at_run_time as raise_at_run_time
from ._inputs import PiecewiseConstant as PiecewiseConstant
from ._jacobian import forward_gradient as forward_gradient
from ._jacobian import jacobian as jacobian
from ._kept import kept_value as kept_value
from ._kept import note_value as note_value
from ._solution import Solution as Solution
from ._solve import solve as solve
from ._solver import RK4 as RK4
from ._solver import AbstractAdaptiveSolver as AbstractAdaptiveSolver
from ._solver import AbstractImplicitSolver as AbstractImplicitSolver
from ._solver import AbstractSolver as AbstractSolver
from ._solver import Bosh3 as Bosh3
from ._solver import ButcherTableau as ButcherTableau
from ._solver import Dopri5 as Dopri5
from ._solver import Euler as Euler
from ._solver import Kvaerno3 as Kvaerno3
from ._solver import Kvaerno5 as Kvaerno5
from ._solver import Tsit5 as Tsit5
from ._step_size import AbstractStepSizeController as AbstractStepSizeController
from ._step_size import ConstantStepSize as ConstantStepSize
from ._step_size import PIDController as PIDController
