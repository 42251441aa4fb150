"""Stan's window adaptation, one transition at a time.

blackjax's `window_adaptation` runs the whole warm-up as a `lax.scan` of its
own, a program apart from the draws' NUTS transitions: two compiled programs,
each holding NUTS and the gradient of the log density. Here the same
adaptation (blackjax's dual averaging of the step size and Welford windows of
the mass matrix, on Stan's schedule from blackjax's `build_schedule`) is an
update applied after each transition whose code says so, so that the warm-up
and the draws are transitions of one compiled program (`_nuts.Programs`).

A transition's code is a bit set: `SLOW` (a slow window: the mass matrix
accumulates the position), `WINDOW_END` (the last transition of a slow
window: the mass matrix is recomputed, the step size's dual averaging
restarts from its average), `LAST` (the last warm-up transition: the
parameters are the final ones, the step size the dual average's) and `DRAW`
(no adaptation). The updates are blackjax's own functions, in the order its
window adaptation applies them, so the warm-up ends where blackjax's does, to
rounding (`tests/test_sample_program.py`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from blackjax.adaptation.mass_matrix import mass_matrix_adaptation
from blackjax.adaptation.step_size import dual_averaging_adaptation
from blackjax.adaptation.window_adaptation import build_schedule

__all__ = ["DRAW", "Adaptation", "codes", "engine", "like"]

SLOW, WINDOW_END, LAST, DRAW = 1, 2, 4, 8
INITIAL_STEP_SIZE = 1.0  # blackjax's window adaptation's default


class Adaptation(NamedTuple):
    """The warm-up's state: the dual averaging's and the mass matrix's."""

    step: tuple
    mass: tuple


def codes(warmup: int) -> np.ndarray:
    """The code of each of `warmup` transitions (int32, `(warmup,)`)."""
    if warmup == 0:
        return np.zeros(0, np.int32)
    schedule = np.asarray(build_schedule(warmup), np.int32).reshape(warmup, 2)
    out = schedule[:, 0] * SLOW + schedule[:, 1] * WINDOW_END
    out[-1] |= LAST
    return out.astype(np.int32)


def like(tree, ref):
    """`tree` cast leaf by leaf to the dtypes of `ref`, not weakly typed: a
    `lax.cond`'s branches, and a program's carry from call to call, keep
    one type."""
    return jax.tree.map(
        lambda v, r: jax.lax.convert_element_type(v, r.dtype), tree, ref
    )


def engine(diagonal: bool, target_accept: float):
    """`(init, update)` of the adaptation.

    `init(position, imm0)`: the state before the first transition (the first
    inverse mass matrix `imm0`, step size 1; its leaves may be weakly typed:
    a program's carry casts them with `like`). `update(state, code, position,
    acceptance_rate)`: the state after a warm-up transition of `code` that
    moved to `position`, with the step size and inverse mass matrix of the
    next transition.
    """
    da_init, da_update, da_final = dual_averaging_adaptation(target_accept)
    mm_init, mm_update, mm_final = mass_matrix_adaptation(diagonal)

    def init(position, imm0) -> Adaptation:
        mass = mm_init(position.size)._replace(inverse_mass_matrix=imm0)
        return Adaptation(da_init(INITIAL_STEP_SIZE), mass)

    def update(state: Adaptation, code, position, acceptance_rate):
        step = like(da_update(state.step, acceptance_rate), state.step)
        mass = jax.lax.cond(code & SLOW != 0, lambda m: like(mm_update(m, position), m),
                            lambda m: m, state.mass)  # fmt: skip

        def window_end(step, mass):
            return like((da_init(da_final(step)), mm_final(mass)), (step, mass))

        step, mass = jax.lax.cond(code & WINDOW_END != 0, window_end,
                                  lambda s, m: (s, m), step, mass)  # fmt: skip
        new = Adaptation(step, mass)
        size = jnp.where(code & LAST != 0, step.log_step_size_avg, step.log_step_size)
        return new, jnp.exp(size), mass.inverse_mass_matrix

    return init, update
