"""The segment grid, the step loop inside one segment, and the scan over segments.

A solve runs over *segments*: the intervals between consecutive points of the
union of the save times and the input break times. Inside a segment the inputs
are constant, so the vector field is smooth there; the solver state (FSAL) is
rebuilt at each boundary. Segment ends are exact: the last step of a segment is
clipped to land on its end.
"""

from __future__ import annotations

from typing import NamedTuple

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from ._errors import Result
from ._misc import rms_norm, tree_all_finite, tree_where
from ._solver import AbstractAdaptiveSolver
from ._step_size import AbstractAdaptiveStepSizeController, ConstantStepSize


class Grid(NamedTuple):
    """Concrete (NumPy) description of the segments of a solve."""

    bounds: np.ndarray  # (n_seg + 1,) segment boundaries
    input_index: np.ndarray  # (n_seg,) which input value holds on each segment
    save_index: np.ndarray  # (n_save,) index into bounds of each save time
    n_fixed: np.ndarray  # (n_seg,) steps per segment for ConstantStepSize (else 1)


def make_grid(ts: np.ndarray, input_times: np.ndarray | None, dt0_fixed: float | None):
    ts = np.asarray(ts, dtype=np.float64)
    t0, t1 = ts[0], ts[-1]
    pts = [ts]
    if input_times is not None:
        it = np.asarray(input_times, dtype=np.float64)
        pts.append(it[(it > t0) & (it < t1)])
    allpts = np.unique(np.concatenate(pts))
    # Merge boundaries closer than rounding (e.g. 0.5 - 1e-17 and 0.5).
    scale = max(1.0, abs(t0), abs(t1))
    keep = np.concatenate([[True], np.diff(allpts) > 1e-12 * scale])
    bounds = allpts[keep]
    if bounds.size < 2:
        raise ValueError(
            f"solve needs ts spanning an interval; got ts from {t0} to {t1}."
        )
    if input_times is None:
        input_index = np.zeros(bounds.size - 1, dtype=np.int32)
    else:
        it = np.asarray(input_times, dtype=np.float64)
        k = np.searchsorted(it, bounds[:-1] + 1e-12 * scale, side="right") - 1
        input_index = np.clip(k, 0, it.size - 1).astype(np.int32)
    save_index = np.searchsorted(bounds, ts - 1e-12 * scale, side="left").astype(
        np.int32
    )
    if dt0_fixed is None:
        n_fixed = np.ones(bounds.size - 1, dtype=np.int32)
    else:
        n_fixed = np.maximum(
            1, np.ceil(np.diff(bounds) / dt0_fixed - 1e-9).astype(np.int32)
        )
    return Grid(bounds, input_index, save_index, n_fixed)


class SegmentStats(NamedTuple):
    n_accepted: jax.Array
    n_rejected: jax.Array
    n_evals: jax.Array


def _zero_stats():
    z = jnp.zeros((), jnp.int32)
    return SegmentStats(z, z, z)


def _add_stats(a, b):
    return SegmentStats(*(x + y for x, y in zip(a, b, strict=True)))


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

    def _first_dt(self, a, b, y, args, u, dt, fstate):
        """Where `dt <= 0` (the first segment without `dt0`), the first step:
        `0.01 * ||y|| / ||f(y)||` in the controller's scaled norm (the first half
        of Hairer's heuristic), from the first-same-as-last state when there is
        one. The controller grows it by up to `factormax` per accepted step."""
        c = self.controller
        first = dt <= 0
        # Only the first segment needs (and, without a first-same-as-last
        # state, counts) the evaluation of f(y).
        extra = 0 if self.carries_fsal else 1

        def scaled(x):
            return rms_norm(
                jtu.tree_map(lambda xi, yi: xi / (c.atol + c.rtol * jnp.abs(yi)), x, y)
            )

        def guess():
            f0 = fstate if self.carries_fsal else self.vf(a, y, args, u)
            d0, d1 = scaled(y), scaled(f0)
            h0 = jnp.where((d0 < 1e-5) | (d1 < 1e-5), 1e-6, 0.01 * d0 / d1)
            h0 = jnp.where(jnp.isfinite(h0), h0, b - a).astype(a.dtype)
            return jnp.minimum(h0, b - a)

        # A `cond`, not a `where`: the two norms over the state are needed by
        # the first segment only, and a `where` would compute them in every
        # segment (measured on the reference forward loss, interleaved in one
        # process: 25.9 against 27.1 ms median).
        dt_first = lax.cond(first, guess, lambda: jnp.asarray(dt, a.dtype))
        return dt_first, jnp.where(first, extra, 0).astype(jnp.int32)

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
        """
        if self.adaptive:
            return self._adaptive_segment(
                a, b, y, args, u, dt, record, active, quad, keep_first, fsal_in
            )
        if quad is not None:
            raise NotImplementedError("quadrature needs an adaptive controller")
        return self._fixed_segment(a, b, y, args, u, dt, n_fixed, record, active)

    def _fixed_segment(self, a, b, y, args, u, dt, n_fixed, record, active):
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
    ):
        solver, vf, ctrl = self.solver, self.vf, self.controller
        error_order = solver.error_order
        if fsal_in is None:
            fstate, ne0 = solver.init(vf, a, y, args, u)
        else:
            f_prev, reuse = fsal_in

            def fresh():
                f, n = solver.init(vf, a, y, args, u)
                return f, jnp.asarray(n, jnp.int32)

            fstate, ne0 = lax.cond(
                reuse, lambda: (f_prev, jnp.zeros((), jnp.int32)), fresh
            )
        cstate = ctrl.init(a.dtype)
        dt, ne_first = self._first_dt(a, b, y, args, u, dt, fstate)
        ne0 = ne0 + ne_first
        times = jnp.zeros((self.max_steps if record else 0,), a.dtype)
        eps = jnp.finfo(a.dtype).eps
        dtmin = jnp.maximum(ctrl.dtmin, 16 * eps * jnp.maximum(jnp.abs(b), 1.0))
        zero = jnp.zeros((), jnp.int32)

        class Carry(NamedTuple):
            t: jax.Array
            y: object
            fstate: object
            dt: jax.Array
            cstate: object
            n_acc: jax.Array
            n_rej: jax.Array
            nfe: jax.Array
            code: jax.Array
            times: jax.Array
            acc: object
            first: object

        def cond(c):
            return (c.t < b) & (c.code == Result.SUCCESSFUL) & active

        def body(c):
            last = c.t + c.dt >= b
            t1 = jnp.where(last, b, c.t + c.dt)
            h = t1 - c.t
            if keep_first:
                y1, y_err, fnew, ne, stages = solver.step_with_stages(
                    vf, c.t, t1, c.y, args, u, c.fstate
                )
            else:
                y1, y_err, fnew, ne = solver.step(vf, c.t, t1, c.y, args, u, c.fstate)
            sel = self.norm_select
            if sel is None:
                accept, dt_next, cnew = ctrl.adapt(
                    c.y, y1, y_err, h, error_order, c.cstate
                )
            else:
                accept, dt_next, cnew = ctrl.adapt(
                    sel(c.y), sel(y1), sel(y_err), h, error_order, c.cstate
                )
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
            if record:
                times = c.times.at[jnp.minimum(c.n_acc, self.max_steps - 1)].set(
                    jnp.where(
                        accept, t1, c.times[jnp.minimum(c.n_acc, self.max_steps - 1)]
                    )
                )
            else:
                times = c.times
            if keep_first:
                first = tree_where(accept & (c.n_acc == 0), stages, c.first)
            else:
                first = c.first
            # Only a failing step asks why: no reduction on the others
            # (measured: 3-4% of the reference forward solve).
            finite_y1 = lax.cond(
                dt_next < dtmin, lambda: tree_all_finite(y1), lambda: jnp.array(True)
            )
            done = t >= b
            code = jnp.where(
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
            return Carry(
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
            )

        dt = jnp.minimum(dt, b - a)
        acc0 = None if quad is None else quad[1]
        if keep_first:
            s = solver.n_kept_stages
            first0 = jtu.tree_map(lambda x: jnp.zeros((s, *x.shape), x.dtype), y)
        else:
            first0 = None
        init = Carry(
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
        )
        c = lax.while_loop(cond, body, init)
        stats = SegmentStats(c.n_acc, c.n_rej, c.nfe)
        times = (c.times, c.first) if keep_first else c.times
        out = (c.y, c.dt, stats, c.code, c.t, times)
        if quad is not None:
            out = (*out, c.acc)
        if fsal_in is not None:
            out = (*out, c.fstate)
        return out

    # ---------------------------------------------------------------- full scan
    def run(self, grid: Grid, y0, args, values, dt0, record: bool, keep_first=False):
        """Scan over all segments.

        Returns `(ys, stats, fail, times, n_acc)`: `ys` stacks the state at every
        segment boundary (leading axis `n_seg + 1`); `fail` is
        `(code, segment, t)` of the first failure (code 0 if none). With
        `keep_first` (see `segment`; only when `can_keep_first`), `times` is
        `(times, stages)`, each with a leading segment axis.
        """
        keep_first = keep_first and record and self.can_keep_first
        dtype = jnp.result_type(*jtu.tree_leaves(y0))
        bounds = jnp.asarray(grid.bounds, dtype)
        # A boundary that is only a save time leaves the inputs as they were:
        # the vector field at the start of the next segment is the last
        # first-same-as-last stage of this one, so it is not evaluated again.
        same = np.zeros(grid.input_index.size, dtype=bool)
        same[1:] = grid.input_index[1:] == grid.input_index[:-1]
        xs = (
            bounds[:-1],
            bounds[1:],
            jnp.asarray(grid.input_index),
            jnp.asarray(grid.n_fixed),
            jnp.arange(grid.input_index.size, dtype=jnp.int32),
            jnp.asarray(same),
        )
        carry_f = self.carries_fsal

        def u_at(k):
            if values is None:
                return None
            return jtu.tree_map(
                lambda v: lax.dynamic_index_in_dim(v, k, 0, False), values
            )

        stats0 = _zero_stats()
        if self.adaptive:
            if dt0 is None:
                # A negative step asks the first segment to choose one from the
                # vector field it evaluates anyway (see _adaptive_segment).
                dt_init = jnp.asarray(-1.0, dtype)
            else:
                dt_init = jnp.asarray(dt0, dtype)
        else:
            dt_init = jnp.asarray(0.0, dtype)

        class Carry(NamedTuple):
            y: object
            dt: jax.Array
            stats: SegmentStats
            code: jax.Array
            seg: jax.Array
            t_fail: jax.Array
            f: object

        def body(c, x):
            a, b, idx, n_fixed, k, same_u = x
            u = u_at(idx)

            active = c.code == Result.SUCCESSFUL
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
            )
            y, dt, st, code, t_end, times = out[:6]
            f_out = out[6] if carry_f else None
            code = jnp.where(active, code, c.code)
            new_fail = (c.code == 0) & (code != 0)
            out_y = tree_where(
                code != 0, jtu.tree_map(lambda v: jnp.full_like(v, jnp.nan), y), y
            )
            carry = Carry(
                y,
                dt,
                _add_stats(c.stats, st),
                code,
                jnp.where(new_fail, k, c.seg),
                jnp.where(new_fail, t_end, c.t_fail),
                f_out,
            )
            return carry, (out_y, times, st.n_accepted)

        init = Carry(
            y0,
            dt_init,
            stats0,
            jnp.zeros((), jnp.int32),
            jnp.zeros((), jnp.int32),
            bounds[0],
            jtu.tree_map(jnp.zeros_like, y0) if carry_f else None,
        )
        c, (ys, times, n_acc) = lax.scan(body, init, xs)
        ys = jtu.tree_map(lambda a, b: jnp.concatenate([a[None], b], 0), y0, ys)
        return ys, c.stats, (c.code, c.seg, c.t_fail), times, n_acc


def check_solver_controller(solver, controller):
    if isinstance(controller, AbstractAdaptiveStepSizeController):
        if not isinstance(solver, AbstractAdaptiveSolver):
            raise ValueError(
                f"{type(controller).__name__} needs an adaptive solver such as "
                f"Tsit5(); "
                f"got {type(solver).__name__}(). Use "
                "stepsize_controller=ConstantStepSize(dt0) for fixed steps."
            )
    elif not isinstance(controller, ConstantStepSize):
        raise TypeError(
            "stepsize_controller must be a PIDController or a ConstantStepSize; got "
            f"{type(controller).__name__}."
        )
