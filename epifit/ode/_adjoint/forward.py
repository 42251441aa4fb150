"""Forward sensitivities."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax.flatten_util import ravel_pytree

from ._common import in_forward_mode, materialize, perturbed_index
from .base import AbstractAdjoint


class ForwardAdjoint(AbstractAdjoint):
    """Gradients from forward sensitivities (`jax.jvp` through the solve).

    The backward pass of `jax.grad` computes `Jᵀ c` column by column: for each
    differentiated scalar `p_i` (every element of the perturbed leaves of
    `y0`, `args` and the input values) one forward-sensitivity solve
    `∂y/∂p_i`, contracted with the cotangent. Directions are vectorised in
    batches of `chunk`.

    **Memory**: `O(n_segments * |y| * chunk)`. **Cost**: about
    `n_directions / chunk` batched forward solves with tangents: the best choice
    for a handful of parameters (SIR-type fits), the worst for neural
    sub-models or per-day inputs. For Gauss-Newton and Laplace approximations
    the full Jacobian of the trajectory comes from [`epifit.ode.jacobian`][],
    which runs any solve in forward mode.

    Args:
        chunk: the number of tangent directions solved together.
    """

    chunk: int = eqx.field(static=True, default=16)

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

        def fwd(y_p, a_p, v_p):
            ls = [[p.value for p in ps] for ps in (y_p, a_p, v_p)]
            box["idx"] = [
                perturbed_index(vals, [p.perturbed for p in ps])
                for vals, ps in zip(ls, (y_p, a_p, v_p), strict=True)
            ]
            out = plain(*ls)
            return out, ls

        def bwd(ls, ct):
            idx = box["idx"]
            ct_ys = jtu.tree_map(materialize, ct[0])
            sub = [[ls[g][i] for i in idx[g]] for g in range(3)]
            flat, unravel = ravel_pytree(sub)
            n_dir = flat.size

            def ys_of(p):
                parts = unravel(p)
                full = [list(ls[g]) for g in range(3)]
                for g in range(3):
                    for i, x in zip(idx[g], parts[g], strict=True):
                        full[g][i] = x
                return plain(*full)[0]

            def directional(e):
                _, dys = jax.jvp(ys_of, (flat,), (e,))
                return sum(
                    jnp.vdot(c, d)
                    for c, d in zip(
                        jtu.tree_leaves(ct_ys), jtu.tree_leaves(dys), strict=True
                    )
                )

            chunk = min(self.chunk, max(n_dir, 1))
            n_chunks = -(-n_dir // chunk)
            eye = jnp.eye(n_dir, dtype=flat.dtype)
            pad = jnp.zeros((n_chunks * chunk - n_dir, n_dir), flat.dtype)
            basis = jnp.concatenate([eye, pad]).reshape(n_chunks, chunk, n_dir)
            grads = lax.map(jax.vmap(directional), basis).reshape(-1)[:n_dir]
            parts = unravel(grads.astype(flat.dtype))
            out = []
            for g in range(3):
                leaves = [None] * len(ls[g])
                for i, x in zip(idx[g], parts[g], strict=True):
                    leaves[i] = x
                out.append(leaves)
            return tuple(out)

        run.defvjp(fwd, bwd, symbolic_zeros=True)
        return run(y0_l, a_l, v_l)
