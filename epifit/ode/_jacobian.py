"""Jacobians of solves by forward-mode differentiation."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import CustomVJPPrimal

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


def forward_gradient(fun):
    """`fun(x, data)`, a scalar, whose gradient in `x` comes from forward mode.

    The returned function computes what `fun` does; its reverse-mode
    derivative (`jax.grad`, `jax.value_and_grad`, a sampler's gradient) is
    formed in the forward pass as the `n` directional derivatives of `fun`
    along the unit vectors of `x` (`n` its size), vectorised into one solve
    carrying `n` tangents (every solve inside run forward-differentiably, as
    in [`jacobian`][epifit.ode.jacobian]); the backward pass only scales
    that gradient by the cotangent. For a handful of parameters and a small
    state this one batched solve is cheaper than a reverse adjoint's forward
    and backward passes (SciMLSensitivity's default picks forward mode for
    small problems for the same reason); its cost grows with `n`, so it is
    the wrong choice for many parameters. Where `data` is differentiated
    too, the derivative is `fun`'s own (its solves' adjoints).

    Higher derivatives pass through: the forward pass is differentiable.

    Args:
        fun: a function of a floating array `x` and a pytree `data`,
            returning a scalar.

    Returns:
        The function, with that derivative.
    """

    @jax.custom_vjp
    def wrapped(x, data):
        return fun(x, data)

    def fwd(x, data):
        leaves = jax.tree.leaves(data, is_leaf=_is_primal)
        data_v = jax.tree.map(lambda p: p.value, data, is_leaf=_is_primal)
        if any(p.perturbed for p in leaves):
            value, pull_back = jax.vjp(fun, x.value, data_v)
            return value, (None, pull_back)
        xv = x.value

        def along(e):
            return jax.jvp(lambda x_: fun(x_, data_v), (xv,), (e,))

        basis = jnp.eye(xv.size, dtype=xv.dtype).reshape(xv.size, *xv.shape)
        with forward_mode():
            value, grad = jax.vmap(along, out_axes=(None, 0))(basis)
        return value, (grad.reshape(xv.shape), None)

    def bwd(res, ct):
        grad, pull_back = res
        if pull_back is not None:
            return pull_back(ct)
        return ct * grad, None

    wrapped.defvjp(fwd, bwd, symbolic_zeros=True)
    return functools.wraps(fun)(wrapped)


def _is_primal(x) -> bool:
    return isinstance(x, CustomVJPPrimal)
