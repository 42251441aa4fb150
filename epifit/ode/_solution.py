"""The result of a solve."""

from __future__ import annotations

import equinox as eqx
from jaxtyping import Array, Float, Int, PyTree


class Solution(eqx.Module):
    """The output of [`epifit.ode.solve`][].

    Attributes:
        ts: the save times, shape `(time,)`.
        ys: the state at each save time: the state pytree with a leading `time`
            axis on every leaf. Saved states are segment ends, never interpolated.
        stats: `num_accepted_steps`, `num_rejected_steps`, `num_rhs_evals`
            (vector-field evaluations), `num_segments`, `num_input_changes`
            (the segment boundaries where the inputs change: the solver
            restarts there; elsewhere an adaptive first-same-as-last method
            hands its last stage on).
        result: 0 on success, else an [`epifit.ode.Result`][] code.
        failed_segment: the segment where the solve failed (0 on success).
        failed_t: the time at which it failed.
    """

    ts: Float[Array, " time"]
    ys: PyTree[Array]
    stats: dict
    result: Int[Array, ""]
    failed_segment: Int[Array, ""]
    failed_t: Float[Array, ""]
