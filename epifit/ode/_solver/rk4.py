from typing import ClassVar

from ._erk import AbstractERK, ButcherTableau

_TABLEAU = ButcherTableau(
    c=(1 / 2, 1 / 2, 1.0),
    a=((1 / 2,), (0.0, 1 / 2), (0.0, 0.0, 1.0)),
    b=(1 / 6, 1 / 3, 1 / 3, 1 / 6),
)


class RK4(AbstractERK):
    """The classical fourth-order Runge-Kutta method (fixed step; no error estimate)."""

    tableau: ClassVar[ButcherTableau] = _TABLEAU
    order: ClassVar[int] = 4
