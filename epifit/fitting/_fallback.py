"""The Laplace approximation's fallback for negative curvature, as its
message states it (`_uncertainty.py`) and as a fit's reader recognises it
(`FitResult.laplace_fallback`)."""

from __future__ import annotations

__all__ = ["FALLBACK", "is_fallback"]

FALLBACK = (
    "fallback: the covariance is the inverse of the data Hessian with its "
    "negative eigenvalues set to zero plus the prior's Hessian (the "
    "directions above keep the prior's curvature only, so their intervals are "
    "as wide as the prior says)"
)


def is_fallback(message: str) -> bool:
    """Whether a Laplace message (`Laplace.message`, a fit's
    `uncertainty["message"]`) reports the negative-curvature fallback."""
    return FALLBACK in message
