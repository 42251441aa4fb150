"""Kværnø's ESDIRK pairs 3(2) and 5(4): solvers for stiff models."""

from __future__ import annotations

from typing import ClassVar

import equinox as eqx

from ._esdirk import AbstractESDIRK, ESDIRKTableau


def _tableau(gamma, rows, predictor):
    # Abscissae are the row sums (diagonal included), as for any consistent RK.
    c = tuple(sum(row) + gamma for row in rows)
    return ESDIRKTableau(gamma=gamma, c=c, a=rows, predictor=predictor)


# --- Kvaerno3: 4 stages, order 3, embedded order 2 ----------------------------------
# gamma is the root in (1/3, 1/2) of 6 g^3 - 18 g^2 + 9 g - 1 = 0, the value that
# makes the 3-stage SDIRK of order 3 L-stable (Kværnø 2004, Table 1).
_g3 = 0.43586652150845899942
_K3_ROWS = (
    (_g3,),
    ((-4 * _g3**2 + 6 * _g3 - 1) / (4 * _g3), (-2 * _g3 + 1) / (4 * _g3)),
    (
        (6 * _g3 - 1) / (12 * _g3),
        -1 / ((24 * _g3 - 12) * _g3),
        (-6 * _g3**2 + 6 * _g3 - 1) / (6 * _g3 - 3),
    ),
)
_th = 1 / (2 * _g3)
_K3_PREDICTOR = (
    (1.0,),
    (1.0 - _th, _th),  # linear extrapolation of k through c = 0 and c = 2 gamma
    (*_K3_ROWS[1], _g3),  # the embedded (stage-2) weights
)
_KVAERNO3 = _tableau(_g3, _K3_ROWS, _K3_PREDICTOR)

# --- Kvaerno5: 7 stages, order 5, embedded order 4 ----------------------------------
_g5 = 0.26
_K5_ROWS = (
    (_g5,),
    (0.13, 0.84033320996790809),
    (0.22371961478320505, 0.47675532319799699, -0.06470895363112615),
    (
        0.16648564323248321,
        0.10450018841591720,
        0.03631482272098715,
        -0.13090704451073998,
    ),
    (
        0.13855640231268224,
        0.0,
        -0.04245337201752043,
        0.02446657898003141,
        0.61943039072480676,
    ),
    (
        0.13659751177640291,
        0.0,
        -0.05496908796538376,
        -0.04118626728321046,
        0.62993304899016403,
        0.06962479448202728,
    ),
)
# Stage predictors (weights summing to one) as used by OrdinaryDiffEq.jl and diffrax.
_K5_PREDICTOR = (
    (1.0,),
    (-1.366025403784441, 2.3660254037844357),
    (-0.19650552613122207, 0.8113579546496623, 0.38514757148155954),
    (0.10375304369958693, 0.937994698066431, -0.04174774176601781, 0.0),
    (-0.17281112873898072, 0.6235784481025847, 0.5492326806363959, 0.0, 0.0),
    (*_K5_ROWS[4], _g5),  # the embedded (stage-5) weights
)
_KVAERNO5 = _tableau(_g5, _K5_ROWS, _K5_PREDICTOR)


_SHARED_DOC = """
    Args:
        newton_rtol, newton_atol: tolerances of the Newton iteration, in the same
            scaled norm as the step-size controller's error (`None`: the
            controller's `rtol` and `atol`; with `ConstantStepSize`, 1e-8 and
            1e-10).
        newton_max_steps: the most Newton iterations per stage. A stage that has
            not converged by then (or diverges) makes the error estimate
            infinite, so the adaptive step is rejected and shrunk.
        newton_kappa: the iteration stops when the estimated remaining error is
            below `newton_kappa` in that norm (Hairer and Wanner's kappa).

    **Cost per step**: one Jacobian by `jax.jacfwd` (`n` Jacobian-vector
    products for a state of `n` elements, counted as `n` evaluations in
    `num_rhs_evals`), one vector-field evaluation for the explicit stage, one per
    Newton iteration, one dense LU factorisation of `n x n`. Meant for small and
    medium states (up to a few thousand elements); it evaluates `f` slightly
    past the step end for some stages (inputs are constant on a segment, so this
    is harmless).

    ??? cite "Reference"

        Kværnø, A. (2004). Singly diagonally implicit Runge-Kutta methods with an
        explicit first stage. BIT Numerical Mathematics, 44(3), 489-502.
    """


def _shared_doc(cls):
    # Each public class's own docstring, then what both share.
    cls.__doc__ = cls.__doc__.rstrip() + "\n" + _SHARED_DOC
    return cls


class _Kvaerno(AbstractESDIRK):
    """The Newton settings that Kvaerno3 and Kvaerno5 share (documented in
    `_SHARED_DOC`); each subclass brings its own tableau and orders."""

    newton_rtol: float | None = eqx.field(static=True, default=None)
    newton_atol: float | None = eqx.field(static=True, default=None)
    newton_max_steps: int = eqx.field(static=True, default=6)
    newton_kappa: float = eqx.field(static=True, default=1e-2)


@_shared_doc
class Kvaerno3(_Kvaerno):
    """Kværnø's ESDIRK 3(2) pair: L-stable, stiffly accurate, for stiff models
    at loose tolerances.

    Four stages (one explicit, three implicit with a shared diagonal); the
    embedded second-order solution is the third stage, so the error estimate is
    free. The Jacobian is formed and factorised once per step.
    """

    tableau: ClassVar[ESDIRKTableau] = _KVAERNO3
    order: ClassVar[int] = 3
    error_order: ClassVar[int] = 3


@_shared_doc
class Kvaerno5(_Kvaerno):
    """Kværnø's ESDIRK 5(4) pair: L-stable, stiffly accurate; the recommended
    solver for stiff models.

    Seven stages (one explicit, six implicit with a shared diagonal); the
    embedded fourth-order solution is the sixth stage. The Jacobian is formed
    and factorised once per step.
    """

    tableau: ClassVar[ESDIRKTableau] = _KVAERNO5
    order: ClassVar[int] = 5
    error_order: ClassVar[int] = 5
