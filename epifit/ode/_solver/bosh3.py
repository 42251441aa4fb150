from typing import ClassVar

from ._erk import AbstractAdaptiveERK, ButcherTableau

_TABLEAU = ButcherTableau(
    c=(1 / 2, 3 / 4, 1.0),
    a=((1 / 2,), (0.0, 3 / 4), (2 / 9, 1 / 3, 4 / 9)),
    b=(2 / 9, 1 / 3, 4 / 9, 0.0),
    b_error=(2 / 9 - 7 / 24, 1 / 3 - 1 / 4, 4 / 9 - 1 / 3, -1 / 8),
    fsal=True,
)


class Bosh3(AbstractAdaptiveERK):
    """Bogacki-Shampine 3(2) pair: cheap steps for loose tolerances.

    Also the cheaper choice where the inputs' break times or the save times,
    not the tolerance, bound the steps: with daily covariates every segment
    takes one step whatever the solver, and Bosh3's step costs three new
    vector-field evaluations against Tsit5's six, at a lower accuracy (third
    order against fifth; measurements: `epifit/ode/README.md`).

    ??? cite "Reference"

        Bogacki, P., Shampine, L. F. (1989). A 3(2) pair of Runge-Kutta formulas.
        Applied Mathematics Letters, 2(4), 321-325.
    """

    tableau: ClassVar[ButcherTableau] = _TABLEAU
    order: ClassVar[int] = 3
    error_order: ClassVar[int] = 3
