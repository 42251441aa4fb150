"""Stiffly accurate ESDIRK methods solved by a simplified Newton iteration.

A stage of an ESDIRK method (explicit first stage, then implicit stages sharing
one diagonal coefficient `gamma`) solves

    z_i = psi_i + dt * gamma * f(t0 + c_i dt, z_i),
    psi_i = y0 + dt * sum_{j < i} a_ij k_j,      k_i = (z_i - psi_i) / (dt gamma).

The Jacobian `J = df/dy (t0, y0)` is formed once per step with `jax.jacfwd` on
the flattened state, and `I - dt gamma J` is LU-factorised once per step and
reused by every Newton iteration of every stage. The vector field itself only
ever sees the state pytree; flattening is used for the linear algebra alone.

Each stage is a `lax.custom_root`: the forward pass runs the Newton iteration
(a `lax.while_loop`, not differentiated); derivatives come from the implicit
function theorem at the converged stage value, using the exact Jacobian there.
The implicit stages run in a `lax.scan` over a `(stage, n)` buffer of stage
derivatives, so the Newton loop is compiled once rather than once per stage.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, NamedTuple

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import jax.tree_util as jtu
import numpy as np
from jax.flatten_util import ravel_pytree

from .._misc import rms_norm
from .base import AbstractImplicitSolver


class ESDIRKTableau(NamedTuple):
    """A stiffly accurate ESDIRK tableau with an embedded stiffly accurate method.

    Stage 0 is explicit (`k_0 = f(t0, y0)`); stage `i + 1` is implicit with
    abscissa `c[i]`, strictly-lower coefficients `a[i]` (on `k_0 .. k_i`) and
    diagonal `gamma`. `predictor[i]` combines `k_0 .. k_i` into the initial guess
    of `k_{i+1}` (the Newton start is `psi + dt gamma * guess`). The solution is
    the last stage value and the embedded solution is the one before it (both
    methods are stiffly accurate), so the error estimate is their difference.
    """

    gamma: float
    c: tuple[float, ...]
    a: tuple[tuple[float, ...], ...]
    predictor: tuple[tuple[float, ...], ...]


class AbstractESDIRK(AbstractImplicitSolver):
    """An ESDIRK method given by its tableau; see the module docstring."""

    tableau: ClassVar[ESDIRKTableau]
    newton_rtol: eqx.AbstractVar[float | None]
    newton_atol: eqx.AbstractVar[float | None]
    newton_max_steps: eqx.AbstractVar[int]
    newton_kappa: eqx.AbstractVar[float]

    def with_default_tolerances(self, rtol: float, atol: float):
        """This solver, with the Newton tolerances that are unset taken from the
        step-size controller's `rtol` and `atol`."""
        return dataclasses.replace(
            self,
            newton_rtol=rtol if self.newton_rtol is None else self.newton_rtol,
            newton_atol=atol if self.newton_atol is None else self.newton_atol,
        )

    def init(self, vf, t0, y0, args, u):
        # No carried state: every step evaluates f(t0, y0) itself, so a replayed
        # step (`fresh_step`, what the discrete adjoints differentiate) is
        # identical to the step taken in the forward pass.
        return None, 0

    def step(self, vf, t0, t1, y0, args, u, state):
        """One step; `state` is unused (`None`).

        Cost: `n` evaluations for the Jacobian (`jax.jacfwd`, counted as `n`),
        one for `k_0`, one per Newton iteration; one `O(n^3)` LU factorisation
        and an `O(n^2)` solve per Newton iteration, with the flattened state's
        size `n`. Memory: the `(n, n)` Jacobian and the `(stages, n)` stage
        derivatives.
        """
        del state
        tab = self.tableau
        dt = jnp.asarray(t1 - t0)
        gdt = tab.gamma * dt
        y0_flat, unravel = ravel_pytree(y0)
        n = y0_flat.size
        dtype = y0_flat.dtype
        rtol, atol = self._newton_tolerances(dtype)
        lu = _jacobian_lu(vf, t0, y0_flat, unravel, args, u, gdt, dtype)
        newton = _newton_solver(
            unravel, lu, rtol, atol, self.newton_kappa, self.newton_max_steps, dtype
        )
        # One scan over the implicit stages (see the module docstring): XLA
        # compile time, not run time, is the scarce resource on CPU.
        a_mat, p_mat = _stage_matrices(tab)
        n_stages = a_mat.shape[1]
        k0 = ravel_pytree(vf(t0, y0, args, u))[0]
        ks = jnp.zeros((n_stages, n), dtype).at[0].set(k0)

        def stage(ks, x):
            a_i, p_i, c_i, i = x
            ti = t0 + c_i * dt
            psi = y0_flat + dt * (a_i @ ks)
            guess = psi + gdt * (p_i @ ks)

            def residual(z):
                fz = vf(ti, z, args, u)
                return jtu.tree_map(
                    lambda z_, p_, f_: z_ - p_ - gdt * f_, z, unravel(psi), fz
                )

            z, aux = lax.custom_root(
                residual, unravel(guess), newton, _tangent_solve, has_aux=True
            )
            z = ravel_pytree(z)[0]
            ks = ks.at[i].set((z - psi) / gdt)
            return ks, (z, lax.stop_gradient(aux))

        xs = (
            jnp.asarray(a_mat, dtype),
            jnp.asarray(p_mat, dtype),
            jnp.asarray(tab.c, dtype),
            jnp.arange(1, n_stages),
        )
        _, (zs, aux) = lax.scan(stage, ks, xs)
        converged = jnp.all(aux[:, 0] > 0)
        # Jacobian columns, k_0, then one evaluation per Newton iteration.
        n_evals = n + 1 + jnp.sum(aux[:, 1]).astype(jnp.int32)
        y1 = unravel(zs[-1])
        # A stage whose Newton iteration did not converge makes the error
        # estimate infinite, so the step-size controller rejects and shrinks it.
        y_error = unravel(jnp.where(converged, zs[-1] - zs[-2], jnp.inf))
        return y1, y_error, None, n_evals

    def _newton_tolerances(self, dtype):
        """`(rtol, atol)` of the Newton iteration, as Python floats."""
        rtol = _DEFAULT_RTOL if self.newton_rtol is None else self.newton_rtol
        atol = _DEFAULT_ATOL if self.newton_atol is None else self.newton_atol
        # Below ~1e3 eps the increments are rounding noise: never ask for more.
        rtol = max(rtol, 1e3 * float(jnp.finfo(dtype).eps))
        return rtol, atol


def _jacobian_lu(vf, t0, y0_flat, unravel, args, u, gdt, dtype):
    """The LU factors of `I - dt gamma J`, `J = df/dy (t0, y0)` on the
    flattened state (`n` forward-mode evaluations, one factorisation)."""
    # The Jacobian only steers the Newton iteration (the converged stages do
    # not depend on it), so it is a constant for differentiation.
    t0_c, y0_c, args_c, u_c, gdt_c = lax.stop_gradient((t0, y0_flat, args, u, gdt))

    def flat_vf(y_flat):
        return ravel_pytree(vf(t0_c, unravel(y_flat), args_c, u_c))[0]

    jac = jax.jacfwd(flat_vf)(y0_c).astype(dtype)
    n = y0_flat.size
    return jsl.lu_factor(jnp.eye(n, dtype=dtype) - gdt_c.astype(dtype) * jac)


def _newton_solver(unravel, lu, rtol, atol, kappa, max_steps, dtype):
    """The forward solve of a stage's `lax.custom_root`: a simplified Newton
    iteration with the LU factors `lu`, at most `max_steps` iterations, each
    one evaluation of the residual and one LU solve. Returns the stage and,
    as floating aux, `(converged, iterations)`."""
    eps = jnp.finfo(dtype).eps

    def newton(residual, z_guess):
        z0 = ravel_pytree(z_guess)[0]

        def cond(c):
            i, _, _, conv, fail = c
            return (i < max_steps) & ~conv & ~fail

        def body(c):
            i, z, dn_prev, _, _ = c
            r = ravel_pytree(residual(unravel(z)))[0]
            dz = -jsl.lu_solve(lu, r)
            z = z + dz
            dn = rms_norm(dz / (atol + rtol * jnp.abs(z)))
            # Convergence rate and Hairer-Wanner's estimate of the remaining
            # error, eta * |dz| (IV.8.14); the first iteration has no rate.
            theta = dn / jnp.maximum(dn_prev, jnp.finfo(dtype).tiny)
            eta = jnp.where(i == 0, 1.0, theta / jnp.maximum(1.0 - theta, eps))
            conv = ((i == 0) | (theta < 1.0)) & (eta * dn <= kappa)
            conv = conv | (dn <= 1e-2 * kappa)
            fail = ~jnp.isfinite(dn) | ((i > 0) & (theta >= 1.0) & ~conv)
            return i + 1, z, dn, conv, fail

        init = (
            jnp.zeros((), jnp.int32),
            z0,
            jnp.asarray(jnp.inf, dtype),
            jnp.asarray(False),
            jnp.asarray(False),
        )
        n_iter, z, _, conv, _ = lax.while_loop(cond, body, init)
        # Floating aux: custom_root's JVP gives integer aux a non-float0
        # tangent, which JAX then rejects.
        return unravel(z), jnp.stack([conv, n_iter]).astype(dtype)

    return newton


def _tangent_solve(g, y):
    """The linear solve of a stage's `lax.custom_root`: the exact
    linearisation at the root (only used when differentiating)."""
    y_flat, unr = ravel_pytree(y)
    mat = jax.jacfwd(lambda x: ravel_pytree(g(unr(x)))[0])(jnp.zeros_like(y_flat))
    return unr(jnp.linalg.solve(mat, y_flat))


def _stage_matrices(tab):
    """The implicit stages' coefficients and predictors as zero-padded
    `(stages - 1, stages)` NumPy arrays, one row per scanned stage."""
    n_stages = len(tab.c) + 1
    a_mat = np.zeros((n_stages - 1, n_stages))
    p_mat = np.zeros((n_stages - 1, n_stages))
    for i, (ai, pi) in enumerate(zip(tab.a, tab.predictor, strict=True)):
        a_mat[i, : len(ai)] = ai
        p_mat[i, : len(pi)] = pi
    return a_mat, p_mat


# Newton tolerances when no adaptive step-size controller supplies them.
_DEFAULT_RTOL = 1e-8
_DEFAULT_ATOL = 1e-10
