"""What a fit says beyond its parameters: the log-likelihood at the fitted
point, AIC and BIC, and notes on the model's structure against the data.

The log-likelihood is computed once, after the optimiser, in the fit's
output program (`epifit.fitting._output`: from the predictions of the final
solve, the sum of each family's log-likelihood, as
`Objective.log_likelihood_at`), so nothing is added to the compiled optimiser
loop and no program of its own is compiled.
"""

from __future__ import annotations

import math
from typing import Any

from epifit.fitting._objective import Objective

__all__ = ["fit_information", "information_criteria", "shared_parameter_note"]


def information_criteria(
    log_likelihood: float, n_parameters: int, n_data: int
) -> tuple[float, float]:
    """`(aic, bic)`: `2 k - 2 logL` and `k ln(n) - 2 logL` (NaN for no data)."""
    aic = 2.0 * n_parameters - 2.0 * log_likelihood
    bic = n_parameters * math.log(n_data) - 2.0 * log_likelihood if n_data else math.nan
    return aic, bic


def shared_parameter_note(objective: Objective) -> str:
    """A one-line note when the problem has more than one patch and some free
    parameters are scalar (one value shared by every patch), which the data
    of each patch could estimate separately; "" otherwise. Information, not
    a warning."""
    problem = objective.problem
    n_patches = len(problem.patches)
    if n_patches < 2:
        return ""
    scalar = {
        p.name
        for p in problem.spec.parameters
        if not (p.per_patch or p.per_stratum or p.per_time)
    }
    shared = [n for n in dict.fromkeys(objective.free.names) if n in scalar]
    if not shared:
        return ""
    verb = "is" if len(shared) == 1 else "are"
    them = "it" if len(shared) == 1 else "them"
    return (
        f"{', '.join(shared)} {verb} shared by all {n_patches} patches (scalar "
        f"parameters); give {them} per_patch = true to fit one value per patch"
    )


def fit_information(objective: Objective, log_likelihood: float) -> dict[str, Any]:
    """The `FitResult` fields `log_likelihood`, `aic`, `bic`, `n_parameters`,
    `n_data`, `notes` and `priors` (every free parameter's prior), from the
    observations' log-likelihood at the fitted point."""
    ll = float(log_likelihood)
    k, n = int(objective.free.n), int(objective.n_data)
    aic, bic = information_criteria(ll, k, n)
    note = shared_parameter_note(objective)
    return dict(
        log_likelihood=ll,
        aic=aic,
        bic=bic,
        n_parameters=k,
        n_data=n,
        notes=[note] if note else [],
        priors=dict(objective.free.records),
    )
