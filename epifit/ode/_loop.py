"""The step loop inside one segment, and the scan over segments.

A solve runs over *segments* (`_grid.make_grid`): the intervals between
consecutive points of the union of the save times and the input break times.
Inside a segment the inputs are constant, so the vector field is smooth there;
the solver state (FSAL) is rebuilt where the inputs change. Segment ends are
exact: the last step of a segment is clipped to land on its end.
"""

from __future__ import annotations

import equinox as eqx
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu

from ._carry import (
    ScanCarry,
    SegmentStats,
    StepCarry,
    add_stats,
    inner_like,
    input_at,
    interpolate_inner,
    segment_xs,
    zero_stats,
)
from ._errors import Result
from ._grid import Grid
from ._misc import tree_all_finite, tree_where
from ._step_size import AbstractAdaptiveStepSizeController, first_step


class Integrator(eqx.Module):
    """Everything static about a solve: the vector field, solver, controller, grid."""

    vf: object = eqx.field(static=True)
    solver: object
    controller: object
    max_steps: int = eqx.field(static=True)
    # Optional: restricts the error norm to part of the state (seminorms).
    norm_select: object = eqx.field(static=True, default=None)
    # Whether a failure raises (`solve(..., throw=...)`); the reverse-mode
    # adjoints apply it to their backward passes too.
    throw: bool = eqx.field(static=True, default=True)

    @property
    def adaptive(self):
        return isinstance(self.controller, AbstractAdaptiveStepSizeController)

    @property
    def can_keep_first(self) -> bool:
        """Whether `run(..., keep_first=True)` records first-step stages."""
        from ._solver import AbstractERK

        return self.adaptive and isinstance(self.solver, AbstractERK)

    @property
    def carries_fsal(self) -> bool:
        """Whether `run` hands the first-same-as-last stage from one segment to
        the next where the inputs do not change (adaptive FSAL Runge-Kutta)."""
        from ._solver import AbstractERK

        return (
            self.adaptive
            and isinstance(self.solver, AbstractERK)
            and self.solver.tableau.fsal
        )

    # ------------------------------------------------------------------ segment
    def segment(
        self,
        a,
        b,
        y,
        args,
        u,
        dt,
        n_fixed,
        record: bool,
        active=True,
        quad=None,
        keep_first: bool = False,
        fsal_in=None,
        inner=None,
    ):
        """Integrate one segment from `a` to `b`.

        Returns `(y_b, dt_next, stats, code, t_fail, times)` where `times` (when
        `record`) is a buffer of length `max_steps` holding the end time of each
        accepted step, for the discrete adjoint's replay.

        With `keep_first` (an adaptive explicit Runge-Kutta solve, recording),
        `times` is `(times, stages)`: the stage states of the segment's first
        accepted step, which spare the discrete adjoint replaying the segment
        when it took one step (as most daily segments do).

        `quad = (fn, acc0)` accumulates `acc = fn(acc, t0, t1, y0, y1, f0, f1)` over
        the accepted steps of an adaptive segment (with `f0`, `f1` the solver's
        first-same-as-last states); then the accumulator is returned last.

        `fsal_in = (f, reuse)` (adaptive first-same-as-last solvers only; see
        `carries_fsal`): where `reuse`, `f` is the vector field at `(a, y)`
        with this segment's inputs, left by the previous segment, and is not
        evaluated again; the segment then also returns its own last
        first-same-as-last state, last.

        `inner` (adaptive solvers with a dense output only): the times of the
        segment's inner saves (`Grid.inner`, `(K,)`, +inf where none); the
        states there, interpolated inside the steps that contain them
        (`dense_weights`), are returned last, stacked `(K, ...)`.

        Cost: one solver step per attempted step (at most `max_steps`), plus,
        with an adaptive controller, one error norm per step and, in the first
        segment without `dt0`, the first-step heuristic
        (`_step_size.first_step`). Memory: the state, the solver's and the
        controller's states, and `times`.
        """
        if self.adaptive:
            return self._adaptive_segment(
                a, b, y, args, u, dt, record, active, quad, keep_first, fsal_in, inner
            )
        if quad is not None:
            raise NotImplementedError("quadrature needs an adaptive controller")
        return self._fixed_segment(a, b, y, args, u, dt, n_fixed, record, active)

    def _fixed_segment(self, a, b, y, args, u, dt, n_fixed, record, active):
        """[`segment`][] with `ConstantStepSize`: `n_fixed` equal steps in a
        `lax.fori_loop` (none where not `active`); a segment needing more than
        `max_steps` takes only those and fails."""
        solver, vf = self.solver, self.vf
        h = (b - a) / n_fixed.astype(a.dtype)
        fstate, ne0 = solver.init(vf, a, y, args, u)
        times = jnp.zeros((self.max_steps if record else 0,), a.dtype)

        def body(i, carry):
            y, fstate, nfe, times = carry
            t0 = a + i.astype(a.dtype) * h
            t1 = jnp.where(i + 1 == n_fixed, b, t0 + h)
            y1, _, fstate, ne = solver.step(vf, t0, t1, y, args, u, fstate)
            if record:
                times = times.at[i].set(t1)
            return y1, fstate, nfe + ne, times

        n = jnp.where(active, jnp.minimum(n_fixed, self.max_steps), 0)
        y, _, nfe, times = lax.fori_loop(
            0, n, body, (y, fstate, jnp.asarray(ne0, jnp.int32), times)
        )
        finite = tree_all_finite(y)
        code = jnp.where(
            n_fixed > self.max_steps,
            Result.MAX_STEPS_REACHED,
            jnp.where(finite, Result.SUCCESSFUL, Result.NONFINITE_STATE),
        ).astype(jnp.int32)
        stats = SegmentStats(n.astype(jnp.int32), jnp.zeros((), jnp.int32), nfe)
        return y, dt, stats, code, b, times

    def _adaptive_segment(
        self,
        a,
        b,
        y,
        args,
        u,
        dt,
        record,
        active,
        quad=None,
        keep_first=False,
        fsal_in=None,
        inner=None,
    ):
        """[`segment`][] with an adaptive controller: a `lax.while_loop` of
        [`_adaptive_step`][] until `b`, a failure, or `max_steps` attempts.

        Memory: the carry (`StepCarry`), plus `max_steps` step times when
        `record` and one step's stage states with `keep_first`.
        """
        ctrl = self.controller
        fstate, ne0 = self._segment_fsal(a, y, args, u, fsal_in)
        cstate = ctrl.init(a.dtype)
        dt, ne_first = first_step(
            ctrl, self.vf, a, b, y, args, u, dt, fstate, self.carries_fsal
        )
        ne0 = ne0 + ne_first
        times = jnp.zeros((self.max_steps if record else 0,), a.dtype)
        eps = jnp.finfo(a.dtype).eps
        # The smallest step is relative to the time reached, not to `b`: a long
        # segment (a solve saved only at its end) may start with steps far
        # below 16 ulps of its end time.
        dtmin = (ctrl.dtmin, 16 * eps)
        zero = jnp.zeros((), jnp.int32)

        def cond(c):
            return (c.t < b) & (c.code == Result.SUCCESSFUL) & active

        def body(c):
            return self._adaptive_step(
                c, b, args, u, dtmin, record, quad, keep_first, inner
            )

        dt = jnp.minimum(dt, b - a)
        acc0 = None if quad is None else quad[1]
        if keep_first == "values":
            s = self.solver.n_kept_stages - 1
            noted = self.solver.noted_shapes(self.vf, a, y, args, u)
            first0 = jtu.tree_map(lambda x: jnp.zeros((s, *x.shape), x.dtype), noted)
        elif keep_first:
            s = self.solver.n_kept_stages
            first0 = jtu.tree_map(lambda x: jnp.zeros((s, *x.shape), x.dtype), y)
        else:
            first0 = None
        init = StepCarry(
            a,
            y,
            fstate,
            dt,
            cstate,
            zero,
            zero,
            jnp.asarray(ne0, jnp.int32),
            zero,
            times,
            acc0,
            first0,
            None if inner is None else inner_like(inner, y),
        )
        c = lax.while_loop(cond, body, init)
        stats = SegmentStats(c.n_acc, c.n_rej, c.nfe)
        times = (c.times, c.first) if keep_first else c.times
        out = (c.y, c.dt, stats, c.code, c.t, times)
        if quad is not None:
            out = (*out, c.acc)
        if fsal_in is not None:
            out = (*out, c.fstate)
        if inner is not None:
            out = (*out, c.y_inner)
        return out

    def _segment_fsal(self, a, y, args, u, fsal_in):
        """The solver state at the segment start and its evaluations: `init`,
        or (see `segment`'s `fsal_in`) the previous segment's last
        first-same-as-last state where it may be reused, at no evaluation."""
        solver, vf = self.solver, self.vf
        if fsal_in is None:
            return solver.init(vf, a, y, args, u)
        f_prev, reuse = fsal_in

        def fresh():
            f, n = solver.init(vf, a, y, args, u)
            return f, jnp.asarray(n, jnp.int32)

        return lax.cond(reuse, lambda: (f_prev, jnp.zeros((), jnp.int32)), fresh)

    def _adaptive_step(self, c, b, args, u, dtmin, record, quad, keep_first, inner):
        """One attempted step of an adaptive segment: the body of its loop.

        Takes the step `c.dt` (clipped to land on `b`), lets the controller
        accept or reject it, and returns the next `StepCarry`. Cost: one
        solver step, one error norm, and selects over the state; the
        finiteness check reduces over the state only when the step fails;
        with `inner` saves, one interpolation where an accepted step holds
        any.
        """
        last = c.t + c.dt >= b
        t1 = jnp.where(last, b, c.t + c.dt)
        h = t1 - c.t
        y1, y_err, fnew, ne, stages, ks = self._attempt(
            c, t1, args, u, keep_first, inner is not None
        )
        accept, dt_next, cnew = self._adapt(c, y1, y_err, h)
        y_inner = c.y_inner
        if inner is not None:
            y_inner = interpolate_inner(self.solver, c, accept, t1, ks, inner)
        if quad is None:
            acc = c.acc
        else:
            acc = tree_where(
                accept, quad[0](c.acc, c.t, t1, c.y, y1, c.fstate, fnew), c.acc
            )
        # A clipped last step says nothing against the step proposed before it.
        dt_next = jnp.where(
            accept & last & (h < c.dt), jnp.maximum(dt_next, c.dt), dt_next
        )
        t = jnp.where(accept, t1, c.t)
        y_new = tree_where(accept, y1, c.y)
        fstate = tree_where(accept, fnew, c.fstate)
        cstate = tree_where(accept, cnew, c.cstate)
        n_acc = c.n_acc + accept.astype(jnp.int32)
        n_rej = c.n_rej + (~accept).astype(jnp.int32)
        times = self._record_time(c, accept, t1) if record else c.times
        if keep_first:
            first = tree_where(accept & (c.n_acc == 0), stages, c.first)
        else:
            first = c.first
        floor, ulps = dtmin
        dtmin = jnp.maximum(floor, ulps * jnp.maximum(jnp.abs(t), 1.0))
        code = self._step_code(t, b, y1, dt_next, dtmin, n_acc, n_rej)
        return StepCarry(
            t,
            y_new,
            fstate,
            dt_next,
            cstate,
            n_acc,
            n_rej,
            c.nfe + ne,
            code,
            times,
            acc,
            first,
            y_inner,
        )

    def _attempt(self, c, t1, args, u, keep_first, slopes=False):
        """The solver's step from `(c.t, c.y)` to `t1`: `(y1, y_error, state,
        n_evals, stages, slopes)`, with the stage states only with
        `keep_first` and every stage's slope only with `slopes`."""
        solver, vf = self.solver, self.vf
        if keep_first or slopes:
            out = solver.step_with_stages(
                vf,
                c.t,
                t1,
                c.y,
                args,
                u,
                c.fstate,
                values=keep_first == "values",
                slopes=slopes,
            )
            stages = out[4] if keep_first else None
            return (*out[:4], stages, out[5] if slopes else None)
        return (*solver.step(vf, c.t, t1, c.y, args, u, c.fstate), None, None)

    def _adapt(self, c, y1, y_err, h):
        """The controller's verdict on a step of size `h`: `(accept, dt_next,
        controller_state)`, with the error norm over `norm_select`'s part of
        the state where one is set."""
        ctrl, error_order, sel = (
            self.controller,
            self.solver.error_order,
            self.norm_select,
        )
        if sel is None:
            return ctrl.adapt(c.y, y1, y_err, h, error_order, c.cstate)
        return ctrl.adapt(sel(c.y), sel(y1), sel(y_err), h, error_order, c.cstate)

    def _record_time(self, c, accept, t1):
        """`c.times` with `t1` written at the slot of the next accepted step
        (the slot is rewritten with its own value on a rejection)."""
        slot = jnp.minimum(c.n_acc, self.max_steps - 1)
        return c.times.at[slot].set(jnp.where(accept, t1, c.times[slot]))

    def _step_code(self, t, b, y1, dt_next, dtmin, n_acc, n_rej):
        """The segment's `Result` after a step: successful while it goes on or
        once it reaches `b`; else a step below `dtmin` (a non-finite state when
        `y1` is not finite) or `max_steps` attempts."""
        # Only a failing step asks why: no reduction over the state on the others.
        finite_y1 = lax.cond(
            dt_next < dtmin, lambda: tree_all_finite(y1), lambda: jnp.array(True)
        )
        done = t >= b
        return jnp.where(
            done,
            Result.SUCCESSFUL,
            jnp.where(
                dt_next < dtmin,
                jnp.where(finite_y1, Result.DT_MIN_REACHED, Result.NONFINITE_STATE),
                jnp.where(
                    n_acc + n_rej >= self.max_steps,
                    Result.MAX_STEPS_REACHED,
                    Result.SUCCESSFUL,
                ),
            ),
        ).astype(jnp.int32)

    # ---------------------------------------------------------------- full scan
    def run(self, grid: Grid, y0, args, values, dt0, record: bool, keep_first=False):
        """Scan over all segments.

        Returns `(ys, stats, fail, times, n_acc)`: `ys` stacks the state at every
        segment boundary (leading axis `n_seg + 1`), then, where the grid has
        inner saves, at those (`n_seg * K` more, row-major); `fail` is
        `(code, segment, t)` of the first failure (code 0 if none). With
        `keep_first` (see `segment`; only when `can_keep_first`), `times` is
        `(times, stages)`, each with a leading segment axis.

        Memory: `O(n_seg * |y|)` for `ys`, plus, when `record`,
        `O(n_seg * max_steps)` step times (and `O(n_seg * stages * |y|)` with
        `keep_first`). Segments after a failure take no step.
        """
        keep_first = keep_first if record and self.can_keep_first else False
        dtype = jnp.result_type(*jtu.tree_leaves(y0))
        bounds = jnp.asarray(grid.bounds, dtype)
        xs = segment_xs(grid, bounds)
        stats0 = zero_stats()
        if self.adaptive:
            if dt0 is None:
                # A negative step asks the first segment to choose one from the
                # vector field it evaluates anyway (see `_step_size.first_step`).
                dt_init = jnp.asarray(-1.0, dtype)
            else:
                dt_init = jnp.asarray(dt0, dtype)
        else:
            dt_init = jnp.asarray(0.0, dtype)

        def body(c, x):
            return self._scan_segment(c, x, args, values, record, keep_first)

        init = ScanCarry(
            y0,
            dt_init,
            stats0,
            jnp.zeros((), jnp.int32),
            jnp.zeros((), jnp.int32),
            bounds[0],
            jtu.tree_map(jnp.zeros_like, y0) if self.carries_fsal else None,
        )
        c, (ys, times, n_acc, y_inner) = lax.scan(body, init, xs)
        if y_inner is None:
            ys = jtu.tree_map(lambda a, b: jnp.concatenate([a[None], b], 0), y0, ys)
        else:
            ys = jtu.tree_map(
                lambda a, b, c: jnp.concatenate(
                    [a[None], b, c.reshape(-1, *a.shape)], 0
                ),
                y0,
                ys,
                y_inner,
            )
        return ys, c.stats, (c.code, c.seg, c.t_fail), times, n_acc

    def _scan_segment(self, c, x, args, values, record, keep_first):
        """One segment of [`run`][]: the body of its scan. Integrates the
        segment unless an earlier one failed, records the first failure, and
        outputs `(state at b, NaN where failed; times; accepted steps)`."""
        a, b, idx, n_fixed, k, same_u, inner = x
        u = input_at(values, idx)

        active = c.code == Result.SUCCESSFUL
        carry_f = self.carries_fsal
        fsal_in = (c.f, same_u) if carry_f else None
        out = self.segment(
            a,
            b,
            c.y,
            args,
            u,
            c.dt,
            n_fixed,
            record,
            active,
            None,
            keep_first,
            fsal_in,
            inner,
        )
        y, dt, st, code, t_end, times = out[:6]
        f_out = out[6] if carry_f else None
        code = jnp.where(active, code, c.code)
        new_fail = (c.code == 0) & (code != 0)

        def nan_if_failed(y):
            nan = jtu.tree_map(lambda v: jnp.full_like(v, jnp.nan), y)
            return tree_where(code != 0, nan, y)

        out_y = nan_if_failed(y)
        y_inner = None if inner is None else nan_if_failed(out[-1])
        carry = ScanCarry(
            y,
            dt,
            add_stats(c.stats, st),
            code,
            jnp.where(new_fail, k, c.seg),
            jnp.where(new_fail, t_end, c.t_fail),
            f_out,
        )
        return carry, (out_y, times, st.n_accepted, y_inner)
