from typing import ClassVar

from ._erk import AbstractERK, ButcherTableau

_TABLEAU = ButcherTableau(c=(), a=(), b=(1.0,))


class Euler(AbstractERK):
    """The explicit Euler method (fixed step, first order)."""

    tableau: ClassVar[ButcherTableau] = _TABLEAU
    order: ClassVar[int] = 1
