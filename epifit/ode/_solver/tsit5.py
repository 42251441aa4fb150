from typing import ClassVar

import jax.numpy as jnp

from ._erk import AbstractAdaptiveERK, ButcherTableau

_b = (
    0.09646076681806522951816731316512876,
    0.01,
    0.4798896504144995747752495322905965,
    1.379008574103741893192274821856873,
    -3.290069515436080679901047585711364,
    2.324710524099773982415355918398766,
)
_b_hat = (
    0.09468075576583945807478876255758923,
    0.009183565540343253096776363936645314,
    0.4877705284247615707855642599631228,
    1.234297566930478985655109673884238,
    -2.707712349983525454881109975059322,
    1.866628418170587035753719399566211,
    1 / 66,
)

_TABLEAU = ButcherTableau(
    c=(
        161 / 1000,
        327 / 1000,
        9 / 10,
        0.9800255409045096857298102862870246,
        1.0,
        1.0,
    ),
    a=(
        (161 / 1000,),
        (-0.008480655492356988544426874250230775, 0.3354806554923569885444268742502308),
        (
            2.897153057105493432130432594192939,
            -6.359448489975074843148159912383826,
            4.362295432869581411017727318190887,
        ),
        (
            5.325864828439256604428877920840511,
            -11.74888356406282787774717033978577,
            7.495539342889836208304604784564358,
            -0.09249506636175524925650207933207192,
        ),
        (
            5.861455442946420028659251486982648,
            -12.92096931784710929170611868178336,
            8.159367898576158643180400794539253,
            -0.07158497328140099722453054252582974,
            -0.02826905039406838290900305721271224,
        ),
        _b,
    ),
    b=(*_b, 0.0),
    b_error=tuple(b - bh for b, bh in zip((*_b, 0.0), _b_hat, strict=True)),
    fsal=True,
)


class Tsit5(AbstractAdaptiveERK):
    """Tsitouras' 5(4) Runge-Kutta pair; the recommended default for non-stiff models.

    Seven stages, first-same-as-last: six vector-field evaluations per step.

    ??? cite "Reference"

        Tsitouras, Ch. (2011). Runge-Kutta pairs of order 5(4) satisfying only the
        first column simplifying assumption. Computers & Mathematics with
        Applications, 62(2), 770-775.
    """

    tableau: ClassVar[ButcherTableau] = _TABLEAU
    order: ClassVar[int] = 5
    error_order: ClassVar[int] = 5

    def dense_weights(self, theta):
        """Tsitouras' fourth-order dense output (the weights of the seven
        stages, the last at the new state; the same polynomials as
        diffrax's `Tsit5` interpolation)."""
        t = jnp.asarray(theta)
        t2 = t * t
        w = (
            -1.0530884977290216
            * t
            * (t - 1.3299890189751412)
            * (t2 - 1.4364028541716351 * t + 0.7139816917074209),
            0.1017 * t2 * (t2 - 2.1966568338249754 * t + 1.2949852507374631),
            2.490627285651252793
            * t2
            * (t2 - 2.38535645472061657 * t + 1.57803468208092486),
            -16.54810288924490272
            * (t - 1.21712927295533244)
            * (t - 0.61620406037800089)
            * t2,
            47.37952196281928122
            * (t - 1.203071208372362603)
            * (t - 0.658047292653547382)
            * t2,
            -34.87065786149660974 * (t - 1.2) * (t - 0.666666666666666667) * t2,
            2.5 * (t - 1) * (t - 0.6) * t2,
        )
        return jnp.stack(w, axis=-1)
