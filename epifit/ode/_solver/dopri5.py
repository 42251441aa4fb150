from typing import ClassVar

from ._erk import AbstractAdaptiveERK, ButcherTableau

_b = (35 / 384, 0.0, 500 / 1113, 125 / 192, -2187 / 6784, 11 / 84)
_b_hat = (
    5179 / 57600,
    0.0,
    7571 / 16695,
    393 / 640,
    -92097 / 339200,
    187 / 2100,
    1 / 40,
)

_TABLEAU = ButcherTableau(
    c=(1 / 5, 3 / 10, 4 / 5, 8 / 9, 1.0, 1.0),
    a=(
        (1 / 5,),
        (3 / 40, 9 / 40),
        (44 / 45, -56 / 15, 32 / 9),
        (19372 / 6561, -25360 / 2187, 64448 / 6561, -212 / 729),
        (9017 / 3168, -355 / 33, 46732 / 5247, 49 / 176, -5103 / 18656),
        _b,
    ),
    b=(*_b, 0.0),
    b_error=tuple(b - bh for b, bh in zip((*_b, 0.0), _b_hat, strict=True)),
    fsal=True,
)


class Dopri5(AbstractAdaptiveERK):
    """Dormand-Prince 5(4) pair (the method of `jax.experimental.ode.odeint`).

    ??? cite "Reference"

        Dormand, J. R., Prince, P. J. (1980). A family of embedded Runge-Kutta
        formulae. Journal of Computational and Applied Mathematics, 6(1), 19-26.
    """

    tableau: ClassVar[ButcherTableau] = _TABLEAU
    order: ClassVar[int] = 5
    error_order: ClassVar[int] = 5
