"""Explicit Runge-Kutta methods with stages unrolled at trace time."""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .._kept import injecting, recording
from .._sums import sums_as_additions
from .base import AbstractAdaptiveSolver, AbstractSolver


class ButcherTableau(NamedTuple):
    """A Butcher tableau.

    `a[i]` holds the coefficients of stage `i + 1` (stage 0 is the vector field at
    the start of the step). `b_error` is `b - b_embedded` (`None` without an
    embedded method). `fsal` marks methods whose last stage is evaluated at the
    new state, so it is reused as the first stage of the next step.
    """

    c: tuple[float, ...]
    a: tuple[tuple[float, ...], ...]
    b: tuple[float, ...]
    b_error: tuple[float, ...] | None = None
    fsal: bool = False

    @property
    def n_stages(self) -> int:
        return len(self.b)


def _combine(y0, dt, coeffs, ks):
    """`y0 + dt * sum_j coeffs[j] * ks[j]` per leaf; zero coefficients skipped.

    The coefficients are Python floats, so the sum is unrolled at trace time and
    XLA fuses it into one elementwise kernel per leaf.
    """
    pairs = [(float(c), k) for c, k in zip(coeffs, ks, strict=False) if c != 0.0]
    if not pairs:
        return y0
    cs = [c for c, _ in pairs]

    def leaf(y, *kl):
        acc = kl[0] * cs[0]
        for c, k in zip(cs[1:], kl[1:], strict=True):
            acc = acc + k * c
        step = acc * dt.astype(acc.dtype)
        return step if y is None else y + step.astype(y.dtype)

    if y0 is None:
        return jtu.tree_map(lambda *kl: leaf(None, *kl), *[k for _, k in pairs])
    return jtu.tree_map(leaf, y0, *[k for _, k in pairs])


def _stage_slope(vf, t, y, args, u, like, noted_like=None):
    """`vf(t, y, args, u)` for a stage of the forward step, on the CPU behind
    a `cond` (on `isnan(t)`, whose other branch fills NaN in the structure of
    the slope `like`). With `noted_like` (the shapes of the values the vector
    field notes, [`AbstractERK.noted_shapes`][]), `(slope, noted values)`.

    The stage state `y = y0 + h sum_j a_ij k_j` is then one buffer, not fused
    into every kernel of the vector field, so those kernels are the same for
    every stage and XLA CPU compiles them once (it reuses identical fused
    kernels): on the reference problem the loss compiles 20-28% faster (0.75-
    0.92 against 1.00-1.25 s) and its `value_and_grad` 6-12% faster, for
    0-3% more run time of the loss (the combination written once and read by
    the kernels instead of recomputed in each; measurements:
    `epifit/ode/README.md`). A NaN time gives NaN slopes (its stage state
    is NaN then too: the step fails either way). Other backends call `vf`
    directly.
    """
    ops = (t, y, args, u)
    record = noted_like is not None

    def run(ops):
        if not record:
            return vf(*ops)
        with recording() as noted:
            k = vf(*ops)
        return k, noted

    if jax.default_backend() != "cpu":
        return run(ops)
    shapes = (like, noted_like) if record else like

    def nan(ops):
        return jtu.tree_map(lambda k: jnp.full(k.shape, jnp.nan, k.dtype), shapes)

    return lax.cond(jnp.isnan(t), nan, run, ops)


class AbstractERK(AbstractSolver):
    """An explicit Runge-Kutta method given by its tableau."""

    tableau: ClassVar[ButcherTableau]

    @property
    def n_kept_stages(self) -> int:
        """The stages that influence `y1` (a first-same-as-last method's last
        stage does not): the leading size of the stage states."""
        tab = self.tableau
        return tab.n_stages - 1 if tab.fsal else tab.n_stages

    def init(self, vf, t0, y0, args, u):
        if self.tableau.fsal:
            return vf(t0, y0, args, u), 1
        return None, 0

    def step(self, vf, t0, t1, y0, args, u, state):
        return self.step_with_stages(vf, t0, t1, y0, args, u, state)[:4]

    def noted_shapes(self, vf, t, y, args, u):
        """The values `vf` notes (`note_value`) in one evaluation, as shapes
        (a list; traces `vf` once, runs nothing)."""

        def run():
            with recording() as noted:
                vf(t, y, args, u)
            return noted

        return jax.eval_shape(run)

    def fresh_step_with_values(self, vf, t0, t1, y0, args, u):
        """`(y1, values)`: [`fresh_step`][] (everything evaluated from `y0`)
        and the values its stages after the first noted, as
        [`step_with_stages`][] gives them with `values=True`."""
        state, _ = self.init(vf, t0, y0, args, u)
        out = self.step_with_stages(vf, t0, t1, y0, args, u, state, values=True)
        return out[0], out[4]

    @property
    def has_dense_output(self) -> bool:
        """Whether [`dense_weights`][] interpolates inside a step (methods whose
        last stage is evaluated at the new state)."""
        return self.tableau.fsal

    def dense_weights(self, theta):
        """The weights `w_i(theta)` of the dense output inside a step,
        `y(t0 + theta h) = y0 + h sum_i w_i(theta) k_i` over all the stages
        `k_i` (the last at the new state), shaped `(*theta.shape, stages)`.

        Here the cubic Hermite interpolant of `(y0, k_0, y1, k_last)`, third
        order (Bosh3's, as diffrax's); [`Tsit5`][epifit.ode.Tsit5] has its
        own, fourth order."""
        theta = jnp.asarray(theta)
        t2, t3 = theta * theta, theta * theta * theta
        h01 = 3 * t2 - 2 * t3  # the weight of y1 - y0 = h sum b_i k_i
        h10 = t3 - 2 * t2 + theta  # of h k_0
        h11 = t3 - t2  # of h k_last
        b = jnp.asarray(self.tableau.b, theta.dtype)
        w = h01[..., None] * b.reshape((1,) * theta.ndim + (-1,))
        w = w.at[..., 0].add(h10)
        return w.at[..., -1].add(h11)

    def step_with_stages(
        self, vf, t0, t1, y0, args, u, state, values=False, slopes=False
    ):
        """[`step`][] that also returns the stage states `Y_i` (stacked on a
        new leading axis, in the layout of [`loop_step`][]) of the stages that
        influence `y1`, for the discrete adjoint (unused outputs cost nothing
        once compiled). With `values`, instead of the stage states: the
        values the vector field noted (`note_value`) in the evaluations of
        those stages after the first, each stacked over them (a list, empty
        where it noted none). With `slopes`, the slopes of every stage
        (a tuple, the first-same-as-last stage's last) follow, for the
        dense output ([`dense_weights`][])."""
        tab = self.tableau
        dt = jnp.asarray(t1 - t0)
        if tab.fsal:
            k0 = state
            n_evals = tab.n_stages - 1
        else:
            k0 = vf(t0, y0, args, u)
            n_evals = tab.n_stages
        ks = [k0]
        stage_states = [y0]
        noted = []
        noted_like = self.noted_shapes(vf, t0, y0, args, u) if values else None
        y1 = None
        for i, (ci, ai) in enumerate(zip(tab.c, tab.a, strict=True)):
            yi = _combine(y0, dt, ai, ks)
            stage_states.append(yi)
            if tab.fsal and i == len(tab.a) - 1:
                y1 = yi
                ti = t1
            else:
                ti = t0 + ci * dt
            # every stage records (identical branches, one set of kernels);
            # the stages that influence `y1`, after the first, are kept
            k = _stage_slope(vf, ti, yi, args, u, like=k0, noted_like=noted_like)
            if values:
                k, v = k
                if i < self.n_kept_stages - 1:
                    noted.append(v)
            ks.append(k)
        if y1 is None:
            y1 = _combine(y0, dt, tab.b, ks)
        if tab.b_error is None:
            y_error = None
        else:
            y_error = _combine(None, dt, tab.b_error, ks)
        new_state = ks[-1] if tab.fsal else None
        if values:
            stages = jtu.tree_map(lambda *x: jnp.stack(x), *noted)
        else:
            stages = jtu.tree_map(
                lambda *x: jnp.stack(x), *stage_states[: self.n_kept_stages]
            )
        if slopes:
            return y1, y_error, new_state, n_evals, stages, tuple(ks)
        return y1, y_error, new_state, n_evals, stages

    def _coefficients(self, t0, t1, dtype):
        """The stages that influence `y1`, as arrays: `(s, A, b, c, h)`."""
        s, a, b, c = self._kept_tableau()
        A, b, c = (jnp.asarray(x, dtype) for x in (a, b, c))
        return s, A, b, c, (t1 - t0).astype(dtype)

    def _kept_tableau(self):
        """`(s, a, b, c)` of the stages that influence `y1`, as NumPy arrays
        (`a` square, zero-padded): the leading part of [`_full_tableau`][]."""
        _, a, b, c = self._full_tableau()
        s = self.n_kept_stages
        return s, a[:s, :s], b[:s], c[:s]

    def _full_tableau(self):
        """`(s, a, b, c)` of every stage, the first-same-as-last one (at `y1`)
        included, as NumPy arrays (`a` square, zero-padded)."""
        tab = self.tableau
        s = tab.n_stages
        a = np.zeros((s, s))
        for i, row in enumerate(tab.a):
            a[i + 1, : len(row)] = row
        return s, a, np.asarray(tab.b, float), np.asarray((0.0, *tab.c))

    def _stages(self, f, t0, t1, y0, theta):
        """The stage states `Y_i` of one step, computed in a run-time loop."""
        s, A, b, c, h = self._coefficients(t0, t1, y0.dtype)
        zeros = jnp.zeros((s, *y0.shape), y0.dtype)

        def stage(i, st):
            K, Ys = st
            Yi = y0 + h * jnp.tensordot(A[i], K, axes=1)
            Ki = f(t0 + c[i] * h, Yi, theta)
            # dynamic_update_index_in_dim writes one row in place; `.at[i].set`
            # lowers to a scatter that XLA CPU turns into a select over the
            # row fused with the vector field (see `epifit/ode/README.md`).
            return (
                lax.dynamic_update_index_in_dim(K, Ki, i, 0),
                lax.dynamic_update_index_in_dim(Ys, Yi, i, 0),
            )

        K, Ys = lax.fori_loop(0, s, stage, (zeros, zeros))
        return s, A, b, c, h, (Ys, K)

    def loop_step(self, f, t0, t1, y0, theta):
        """One step on a flat state with the stages in a run-time loop (used by
        the discrete adjoint's replay: one vector-field copy when compiled).

        Returns:
            `(y1, stage_states)`; the stage states feed [`step_vjp`][].
        """
        _, _, b, _, h, (Ys, K) = self._stages(f, t0, t1, y0, theta)
        return y0 + h * jnp.tensordot(b, K, axes=1), Ys

    def step_vjp(
        self,
        f,
        t0,
        t1,
        y0,
        theta,
        ct,
        stage_states=None,
        unroll=False,
        values=None,
        dense=None,
    ):
        """The VJP of one step on a flat state, by the discrete adjoint recursion.

        `f(t, y, theta)` is the vector field with its differentiated arguments
        `theta`. With stages `Y_i = y0 + h sum_j a_ij K_j`, `K_i = f(Y_i)` and
        `y1 = y0 + h sum_i b_i K_i`, the cotangents run backwards over the stages:
        `mu_i = h (b_i ct + sum_j a_ji nu_j)`, `nu_i = (df/dy (Y_i))ᵀ mu_i`,
        and `ct_y0 = ct + sum_i nu_i`, `ct_theta = sum_i (df/dtheta (Y_i))ᵀ mu_i`.

        Only the state cotangents `nu_i` form the recursion; `ct_theta` is
        taken once per step, as the pull-back of `f` batched over the stages
        (`vmap` over `(t_i, Y_i)`, `_theta_vjp`), so each parameter's
        reduction over the state runs once per step instead of once per stage
        (measurements: `epifit/ode/README.md`).

        Both passes loop over the stages at run time (one copy of the vector
        field and one of its VJP in the compiled program, instead of one per
        stage), which keeps the compiled gradient small: XLA's compile time
        grows with every fused kernel. The last stage of a first-same-as-last
        method does not influence `y1` and is skipped.

        `stage_states` (from [`loop_step`][]) saves recomputing the stages.
        With `unroll`, the stages are unrolled at trace time instead: one copy
        of the vector field's VJP per stage in the compiled program, no stage
        buffer and no dynamic indexing (and, without `stage_states`, the
        stages are recomputed from `y0` unrolled too): faster to run, slower
        to compile (measurements: `epifit/ode/README.md`). `values` (with
        `unroll`): the noted values of the stages, handed back to their
        linearisations and the parameters' pull-back (see `_step_vjp_unrolled`).
        `dense = (ct_direct, ct_slopes)` (with `unroll`, no `stage_states`):
        the cotangents of states interpolated inside the step
        (`dense_weights`), as their sum (`y0`'s share) and as cotangents of
        every stage's slope, `h sum_k w_i(theta_k) ct_k` (`(stages, ...)`,
        the first-same-as-last stage's last): that stage, at `y1`, is then
        pulled back too.

        Returns:
            `(ct_y0, ct_theta)`.
        """
        if unroll:
            h = (t1 - t0).astype(ct.dtype)
            return self._step_vjp_unrolled(
                f, t0, h, y0, stage_states, theta, ct, values, dense
            )
        if dense is not None:
            raise NotImplementedError("dense cotangents need unroll=True")
        if stage_states is None:
            s, A, b, c, h, (Ys, _) = self._stages(f, t0, t1, y0, theta)
        else:
            Ys = stage_states
            s, A, b, c, h = self._coefficients(t0, t1, ct.dtype)
        zeros = jnp.zeros((s, *ct.shape), ct.dtype)

        def back(k, st):
            nu, mus = st
            i = s - 1 - k
            mu = h * (b[i] * ct + jnp.tensordot(A[:, i], nu, axes=1))
            _, vjp = jax.vjp(lambda y: f(t0 + c[i] * h, y, theta), Ys[i])
            (d_y,) = vjp(mu)
            return (
                lax.dynamic_update_index_in_dim(nu, d_y, i, 0),
                lax.dynamic_update_index_in_dim(mus, mu, i, 0),
            )

        nu, mus = lax.fori_loop(0, s, back, (zeros, zeros))
        return ct + nu.sum(axis=0), _theta_vjp(f, t0 + c * h, Ys, mus, theta)

    def _step_vjp_unrolled(self, f, t0, h, y0, Ys, theta, ct, values=None, dense=None):
        """[`step_vjp`][] with the stages unrolled at trace time.

        Without the stage states `Ys`, they are recomputed from `y0`, and each
        stage's slope and the linearisation its VJP needs come from one
        evaluation (`jax.vjp`), not two. `values` (the noted values of the
        stages after the first, from `step_with_stages(..., values=True)`),
        with the first stage's computed once (`_with_first_values`), are
        handed back (`kept_value`) to every stage's linearisation and to the
        parameters' batched pull-back. With `dense` (see [`step_vjp`][]) the
        first-same-as-last stage is pulled back too, its value computed once
        like the first's.
        """
        if dense is None:
            s, a, b, c = self._kept_tableau()
        else:
            s, a, b, c = self._full_tableau()
            if Ys is not None:
                raise NotImplementedError("dense cotangents recompute the stages")
        vjps = []
        ks = []
        states = []
        if values is not None:
            y_first = y0 if Ys is None else Ys[0]
            values = _with_first_values(f, t0, y_first, theta, values)
        for i in range(s):
            yi = Ys[i] if Ys is not None else _combine(y0, h, a[i, :i], ks)
            if dense is not None and values is not None and i == s - 1:
                # the first-same-as-last stage's values, computed once
                values = _with_last_values(f, t0 + h, yi, theta, values)
            given = (
                []
                if values is None
                else [jtu.tree_map(lambda a, j=i: a[j], v) for v in values]
            )
            with injecting(given):
                ki, vjp = jax.vjp(
                    lambda y, ci=float(c[i]): f(t0 + ci * h, y, theta), yi
                )
            if Ys is None:  # the slopes build the next stage states
                ks.append(ki)
            vjps.append(vjp)
            states.append(yi)
        nus = [None] * s
        mus = [None] * s
        for i in reversed(range(s)):
            mu = float(b[i]) * ct
            for j in range(i + 1, s):
                if a[j, i] != 0.0:
                    mu = mu + float(a[j, i]) * nus[j]
            mus[i] = h * mu
            if dense is not None:
                mus[i] = mus[i] + dense[1][i]
            (nus[i],) = vjps[i](mus[i])
        total = ct if dense is None else ct + dense[0]
        for x in nus:
            total = total + x
        Ys = jnp.stack(states) if Ys is None else Ys
        ts = t0 + jnp.asarray(c, h.dtype) * h
        return total, _theta_vjp(f, ts, Ys, jnp.stack(mus), theta, values)


def _with_first_values(f, t0, y0, theta, values):
    """`values` (the noted values of the stages after the first, each
    stacked over them) with the first stage's prepended, from an evaluation
    of `f` of which nothing else is used (XLA keeps only what computes
    them), so that every stage's linearisation is handed its value."""
    with recording() as first:
        f(t0, y0, theta)
    return [
        jtu.tree_map(lambda v0, v: jnp.concatenate([v0[None], v]), v0, v)
        for v0, v in zip(first, values, strict=True)
    ]


def _with_last_values(f, t1, y1, theta, values):
    """`values` (each stacked over the stages before) with those `f` notes
    at `(t1, y1)` appended, from an evaluation of which nothing else is
    used (as [`_with_first_values`][])."""
    with recording() as last:
        f(t1, y1, theta)
    return [
        jtu.tree_map(lambda v, v1: jnp.concatenate([v, v1[None]]), v, v1)
        for v, v1 in zip(values, last, strict=True)
    ]


def _theta_vjp(f, ts, Ys, mus, theta, values=None):
    """`sum_i (df/dtheta (t_i, Y_i))ᵀ mu_i`: the parameters' cotangent of a
    step, as one pull-back of `f` batched over the stages (`ts`, `Ys`, `mus`
    stacked on a leading stage axis), so each reduction over the state that
    a parameter's cotangent needs runs once per step, not once per stage.
    `values`, the values `f` notes in every stage (each stacked over the
    stages, as `_with_first_values` gives them), are handed back to its
    linearisation (`kept_value`), which then does not compute them again.
    Its sums over the stages are additions (`sums_as_additions`)."""
    values = [] if values is None else values

    def stage(t, y, v, th):
        with injecting(v):
            return f(t, y, th)

    def pull_back(ts, Ys, mus, theta, values):
        batched = jax.vmap(stage, (0, 0, 0, None))
        _, vjp = jax.vjp(lambda th: batched(ts, Ys, values, th), theta)
        return vjp(mus)[0]

    # the reductions over the stages (and the rows a rate scales) that the
    # pull-back of the broadcasts writes, as additions (see `_sums`)
    return sums_as_additions(pull_back)(ts, Ys, mus, theta, values)


class AbstractAdaptiveERK(AbstractERK, AbstractAdaptiveSolver):
    """An explicit Runge-Kutta pair with an embedded error estimate."""
