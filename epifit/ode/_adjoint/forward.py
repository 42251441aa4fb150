"""Forward sensitivities."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax.flatten_util import ravel_pytree

from ._common import in_forward_mode, materialize, merge, perturbed_index
from .base import AbstractAdjoint


class ForwardAdjoint(AbstractAdjoint):
    """Gradients from forward sensitivities (`jax.jvp` through the solve).

    The backward pass of `jax.grad` computes `Jᵀ c` column by column: for each
    differentiated scalar `p_i` (every element of the perturbed leaves of
    `y0`, `args` and the input values) one forward-sensitivity solve
    `∂y/∂p_i`, contracted with the cotangent. Directions are vectorised in
    batches of `chunk`.

    With at most `chunk` directions the forward pass solves the primal and
    every tangent together (one solve, the tangent states kept for the
    backward pass, which only contracts them with the cotangent); with more,
    the backward pass solves them chunk by chunk, the primal again with each.

    **Memory**: `O(n_segments * |y| * chunk)`. **Cost**: one batched solve
    with tangents for at most `chunk` directions (on the boarding-school SIR,
    3 directions: 0.55x the checkpoint adjoint's gradient, measured in
    `benchmarks/README.md`), else about `n_directions / chunk` of them plus
    the primal: the best choice for a handful of parameters (SIR-type fits),
    the worst for neural sub-models or per-day inputs. For Gauss-Newton and
    Laplace approximations the full Jacobian of the trajectory comes from
    [`epifit.ode.jacobian`][], which runs any solve in forward mode.

    Args:
        chunk: the number of tangent directions solved together.
    """

    chunk: int = eqx.field(static=True, default=16)
    # The tangents run through the forward pass, interpolations included.
    differentiates_inner_saves = True

    def loop(self, integ, grid, y0, args, values, dt0):
        if in_forward_mode():
            ys, stats, fail, _, _ = integ.run(grid, y0, args, values, dt0, record=False)
            return ys, stats, fail
        y0_l, y0_def = jtu.tree_flatten(y0)
        a_l, a_def = jtu.tree_flatten(args)
        v_l, v_def = jtu.tree_flatten(values)
        box = {}

        def plain(y_l, a_l_, v_l_):
            y = jtu.tree_unflatten(y0_def, y_l)
            a = jtu.tree_unflatten(a_def, a_l_)
            v = jtu.tree_unflatten(v_def, v_l_) if v_l_ else values
            ys, stats, fail, _, _ = integ.run(grid, y, a, v, dt0, record=False)
            return ys, stats, fail

        run = jax.custom_vjp(plain)

        def split(ls, idx):
            """The differentiated leaves as one flat vector, and `full(p)`:
            every leaf list with those leaves replaced by `p`'s."""
            sub = [[ls[g][i] for i in idx[g]] for g in range(3)]
            flat, unravel = ravel_pytree(sub)

            def full(p):
                parts = unravel(p)
                return [merge(ls[g], idx[g], parts[g]) for g in range(3)]

            return flat, unravel, full

        def contract(ct_ys, dys):
            """`sum_k <ct, dys_k>` for a batch of tangent states `dys`."""
            return sum(
                jnp.tensordot(d, c, axes=c.ndim)
                for c, d in zip(
                    jtu.tree_leaves(ct_ys), jtu.tree_leaves(dys), strict=True
                )
            )

        def fwd(y_p, a_p, v_p):
            ls = [[p.value for p in ps] for ps in (y_p, a_p, v_p)]
            idx = [
                perturbed_index(vals, [p.perturbed for p in ps])
                for vals, ps in zip(ls, (y_p, a_p, v_p), strict=True)
            ]
            box["idx"] = idx
            flat, _, full = split(ls, idx)
            n_dir = flat.size
            if not 0 < n_dir <= self.chunk:
                return plain(*ls), (ls, None)

            # Few directions: the primal and every tangent in one pass (the
            # primal is not batched under the tangents' vmap), the tangent
            # states kept for the backward pass: one solve, not two.
            def both(e):
                out, tan = jax.jvp(lambda p: plain(*full(p)), (flat,), (e,))
                return out, tan[0]

            eye = jnp.eye(n_dir, dtype=flat.dtype)
            out, dys = jax.vmap(both, out_axes=(None, 0))(eye)
            return out, (ls, dys)

        def bwd(res, ct):
            ls, dys = res
            idx = box["idx"]
            ct_ys = jtu.tree_map(materialize, ct[0])
            flat, unravel, full = split(ls, idx)
            n_dir = flat.size
            if dys is not None:
                grads = contract(ct_ys, dys)
            else:  # chunk by chunk, the primal again with each

                def tangent(e):
                    return jax.jvp(lambda p: plain(*full(p))[0], (flat,), (e,))[1]

                chunk = min(self.chunk, max(n_dir, 1))
                n_chunks = -(-n_dir // chunk)
                eye = jnp.eye(n_dir, dtype=flat.dtype)
                pad = jnp.zeros((n_chunks * chunk - n_dir, n_dir), flat.dtype)
                basis = jnp.concatenate([eye, pad]).reshape(n_chunks, chunk, n_dir)
                grads = lax.map(
                    lambda es: contract(ct_ys, jax.vmap(tangent)(es)), basis
                ).reshape(-1)[:n_dir]
            parts = unravel(grads.astype(flat.dtype))
            return tuple(merge([None] * len(ls[g]), idx[g], parts[g]) for g in range(3))

        run.defvjp(fwd, bwd, symbolic_zeros=True)
        return run(y0_l, a_l, v_l)
