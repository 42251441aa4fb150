"""Jacobians of solves by forward-mode differentiation."""

from __future__ import annotations

import functools

import jax

from ._adjoint._common import forward_mode


def jacobian(fun, argnums=0, *, has_aux=False):
    """`jax.jacfwd(fun)` with every solve inside run forward-differentiably.

    Reverse-mode adjoints wrap a solve in a custom VJP, which forward-mode
    differentiation cannot pass through; within `jacobian` the solves run as
    plain loops, so the Jacobian of a trajectory (residuals) with respect to a
    few parameters costs one batched forward-sensitivity solve. This is what
    Gauss-Newton, Levenberg-Marquardt and Laplace approximations need.

    Args:
        fun: a function of arrays/pytrees that calls [`epifit.ode.solve`][].
        argnums, has_aux: as for `jax.jacfwd`.

    Returns:
        A function computing the Jacobian, as `jax.jacfwd` does.
    """
    jf = jax.jacfwd(fun, argnums=argnums, has_aux=has_aux)

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
        with forward_mode():
            return jf(*args, **kwargs)

    return wrapped
