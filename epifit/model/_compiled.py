"""The compiled model: a `ModelSpec` with its plan, ready to integrate.

[`compile_model`][epifit.model.compile_model] lays out the plan (`_plan`); the
[`CompiledModel`][epifit.model.CompiledModel] then maps parameters between
their coordinates, evaluates what depends on (parameters, day) once per solve
(`_precompute`), and evaluates the right-hand side (`_vector_field`), the
initial state (`_initial`) and the observed series (`_observation`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, ArrayLike, PRNGKeyArray, PyTree

from epifit._custom_types import Args, Params, Y
from epifit._toml import join
from epifit.model._errors import ModelSpecError
from epifit.model._initial import initial_state_of
from epifit.model._load import load_model
from epifit.model._neural import make_mlps, output_layer_mask
from epifit.model._observation import flow_key, quantity, report
from epifit.model._per_time import (
    constrain_coefficients,
    daily_values,
    level_mask,
    n_coefficients,
    unconstrain_coefficients,
)
from epifit.model._plan import Plan, make_plan
from epifit.model._precompute import args_and_inputs, covariate_arrays, day_rule
from epifit.model._section import range_violations
from epifit.model._spec import CovariateSpec, ModelSpec, ObservationSpec
from epifit.model._strata import cell_value, stratum_shape, sum_strata
from epifit.model._transform import check_range, constrain, unconstrain
from epifit.model._vector_field import right_hand_side
from epifit.ode import PiecewiseConstant

__all__ = ["CompiledModel", "as_model", "compile_model"]


class CompiledModel(eqx.Module):
    """A model ready to integrate: parameters, precomputation and vector field.

    Everything here is static configuration (hashable); arrays live in the
    parameter pytree, `args` and `inputs`.

    Examples:
        >>> import jax.numpy as jnp
        >>> from epifit.model import ModelBuilder, compile_model
        >>> b = ModelBuilder("sir")
        >>> b = b.compartment("S").compartment("I").compartment("R")
        >>> b = b.parameter("beta", 0.3, transform="softplus")
        >>> b = b.parameter("gamma", 0.1, transform="softplus")
        >>> b = b.infection("S", "I", transmission="beta", infectious=["I"])
        >>> b = b.transition("I", "R", rate="gamma")
        >>> model = compile_model(b.build())
        >>> params = model.init_params(2)
        >>> args, inputs = model.precompute(params, {})
        >>> y = {"S": jnp.full((1, 2), 0.9), "I": jnp.full((1, 2), 0.1),
        ...      "R": jnp.zeros((1, 2))}
        >>> dy = model.vector_field(0.0, y, args, None)
        >>> [round(float(v), 3) for v in dy["I"][0]]
        [0.017, 0.017]
    """

    spec: ModelSpec = eqx.field(static=True)
    plan: Plan = eqx.field(static=True)
    days: int | None = eqx.field(static=True)
    patches: int | None = eqx.field(static=True)

    def __init__(
        self, spec: ModelSpec, days: int | None = None, patches: int | None = None
    ):
        self.spec = spec
        self.plan = make_plan(spec)
        self.days = None if days is None else int(days)
        self.patches = None if patches is None else int(patches)

    def bind_patches(self, n_patches: int) -> CompiledModel:
        """Bound to `n_patches` patches (`Problem` does it): with `[strata]`,
        per-stratum values are tiled over them onto the cells."""
        if self.spec.strata is None or n_patches == self.patches:
            return self
        return CompiledModel(self.spec, self.days, int(n_patches))

    n_strata = property(lambda self: getattr(self.spec.strata, "size", 1))
    """The strata of `[strata]` (1 without)."""

    def bind_days(self, days: int) -> CompiledModel:
        """This model bound to `days` days (`Problem` does it with the days it
        solves): the number of pieces of a time-varying parameter
        (`ceil(days / per_time)`) and the span of its spline follow from
        them. A model without time-varying parameters is returned as is."""
        if not self.time_varying_parameters or days == self.days:
            return self
        if isinstance(days, bool) or not isinstance(days, int | np.integer):
            raise TypeError(f"days must be an int, got {days!r}")
        if days < 1:
            raise ValueError(f"days must be >= 1, got {days}")
        return CompiledModel(self.spec, int(days), self.patches)

    @property
    def time_varying_parameters(self) -> tuple[str, ...]:
        """The parameters with `per_time`, in spec order."""
        return tuple(p.name for p in self.spec.parameters if p.per_time is not None)

    def _horizon(self) -> int:
        if self.days is None:
            names = join(repr(n) for n in self.time_varying_parameters)
            raise ValueError(
                f"parameter(s) {names} of model '{self.spec.name}' vary in time "
                "(per_time): their coefficients follow from the number of days; "
                "bind the model to its days first (model.bind_days(n_days), "
                "which epifit.simulation.Problem does)"
            )
        return self.days

    def n_coefficients(self, name: str) -> int:
        """The coefficients along time of time-varying parameter `name`."""
        p = {q.name: q for q in self.spec.parameters}[name]
        return n_coefficients(p.per_time, self._horizon())

    def daily_values(
        self, params: Params, n_days: int | None = None, scale: Mapping | None = None
    ) -> dict[str, Array]:
        """The constrained value of every time-varying parameter on days
        `0 .. n_days - 1` (default the bound days), `(day,)` or `(day,
        patch)`; past the bound days pieces and splines keep their last
        value, a periodic parameter goes on with its period; `scale` (`{name:
        () or (patch,)}`: a scenario's) multiplies them, clipped to the bounds."""
        horizon = self._horizon() if self.time_varying_parameters else 0
        n, scale = horizon if n_days is None else int(n_days), scale or {}
        return {
            p.name: daily_values(p, params[p.name], horizon, n, scale.get(p.name))
            for p in self.spec.parameters
            if p.per_time is not None
        }

    # -- description ------------------------------------------------------------
    @property
    def compartments(self) -> tuple[str, ...]:
        """Compartment names, in order."""
        return tuple(c.name for c in self.spec.compartments)

    @property
    def stages(self) -> dict[str, int]:
        """Compartment name -> number of stages."""
        return {c.name: c.stages for c in self.spec.compartments}

    @property
    def observations(self) -> tuple[ObservationSpec, ...]:
        return self.spec.observations

    @property
    def covariates(self) -> tuple[CovariateSpec, ...]:
        """Covariates with their dims and lookup rule."""
        return self.spec.covariates

    @property
    def rule(self) -> str | None:
        """The day lookup rule of the time-varying covariates (`None` if none)."""
        return day_rule(self.spec)

    def state_shapes(self, n_patches: int) -> dict[str, tuple[int, int]]:
        """Compartment -> `(stages, patches)`."""
        return {c.name: (c.stages, n_patches) for c in self.spec.compartments}

    def _fail(self, location: str | None, reason: str) -> ModelSpecError:
        return ModelSpecError(reason, file=self.spec.path, location=location)

    # -- parameters ---------------------------------------------------------------
    def init_params(self, n_patches: int, *, key: PRNGKeyArray | None = None) -> Params:
        """Initial parameters in unconstrained coordinates.

        Args:
            n_patches: the number of patches; per-patch parameters get `(patch,)`.
            key: initialises neural sub-models (one `jr.split` per sub-model, in
                spec order); default: NumPy generators seeded 0, 1, ... in spec
                order (`make_mlp`), which compile nothing.

        Returns:
            `{name: array}` for parameters, `{name: eqx.nn.MLP}` for neural parts.
        """
        if isinstance(n_patches, bool) or not isinstance(n_patches, int | np.integer):
            raise TypeError(f"n_patches must be an int, got {n_patches!r}")
        if n_patches < 1:
            raise ValueError(f"n_patches must be >= 1, got {n_patches}")
        params: dict[str, Any] = {}
        for p in self.spec.parameters:
            value = np.asarray(p.value, dtype=np.float64)
            if p.per_stratum:
                value = np.broadcast_to(value, stratum_shape(p, n_patches, self))
            elif p.per_patch:
                if value.ndim == 1 and value.size != n_patches:
                    raise self._fail(
                        f"parameters.{p.name}.value",
                        f"has {value.size} per-patch values but n_patches = "
                        f"{n_patches}",
                    )
                value = np.broadcast_to(value, (n_patches,))
            # in NumPy, then device_put (jnp.asarray compiles a copy per shape)
            x = unconstrain(p.transform, value, *p.bounds, xp=np)
            if p.per_time is not None:
                x = self._constant_coefficients(p, x, xp=np)
            params[p.name] = jax.device_put(np.asarray(x, jnp.result_type(float)))
        return {**params, **make_mlps(self.spec.neural, key)}

    def coefficients_at(self, name: str, value: ArrayLike) -> Array:
        """The coefficients of time-varying parameter `name` whose value is
        the constrained `value` (`()`, or `(patch,)` when per patch) on every
        day."""
        p = {q.name: q for q in self.spec.parameters}[name]
        x = unconstrain(p.transform, jnp.asarray(value), *p.bounds)
        return self._constant_coefficients(p, x)

    def _constant_coefficients(self, p, x: Array, *, xp: Any = jnp) -> Array:
        """Coefficients of a time-varying parameter constant at the
        unconstrained value `x` (`()` or `(patch,)`): levels `x`, amplitudes 0
        (`xp=np`: in NumPy)."""
        K = n_coefficients(p.per_time, self._horizon())
        x = xp.broadcast_to(x, (K, *xp.shape(x)))
        levels = level_mask(p.per_time, K).reshape((K,) + (1,) * (x.ndim - 1))
        return xp.where(levels, x, 0.0)

    def _check_params(self, params: Mapping[str, Any], what: str) -> None:
        expected = [p.name for p in self.spec.parameters]
        expected += [n.name for n in self.spec.neural]
        missing = [n for n in expected if n not in params]
        if missing:
            raise ValueError(
                f"{what} lacks {join(missing)}; expected entries: {join(expected)}"
            )

    def constrain(self, params: Params) -> dict[str, Any]:
        """Constrained parameter values, plus the derived quantities.

        Neural sub-models are passed through unchanged.
        """
        self._check_params(params, "params")
        out: dict[str, Any] = {}
        for p in self.spec.parameters:
            if p.per_time is not None:
                out[p.name] = constrain_coefficients(p, params[p.name])
            else:
                out[p.name] = constrain(p.transform, params[p.name], *p.bounds)
        for n in self.spec.neural:
            out[n.name] = params[n.name]
        derived = {d.name: d.expression for d in self.spec.derived}
        env = self._on_cells(out)
        for name in self.plan.derived_order:
            out[name] = env[name] = derived[name].evaluate(env)
        return out

    def _on_cells(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """With `[strata]`, the parameters' values on the cell axis."""
        out = dict(values)
        if self.spec.strata is None:
            return out
        for p in self.spec.parameters:
            out[p.name] = cell_value(
                values[p.name], p.per_patch, p.per_stratum, self.patches, self.n_strata
            )
        return out

    def cell_values(self, params: Params) -> dict[str, Any]:
        """`constrain(params)` on the structure axis: with `[strata]`, per-patch
        and per-stratum values expanded to the cells (patch-major)."""
        return self._on_cells(self.constrain(params))

    def range_violations(
        self, values: Mapping[str, Any], daily: Mapping[str, Any] | None = None
    ) -> list[str]:
        """The fields whose required range (rates >= 0, probabilities in [0, 1],
        initial conditions >= 0, populations > 0) the concrete constrained
        `values` (`constrain(params)` at a fitted point) break, as sentences: the
        model file's checks, those reading a time-varying parameter on each day
        of `daily` (`daily_values(params)`; skipped without it), not those
        reading covariates. Cost: one NumPy evaluation per check."""
        skip = set(self.time_varying_parameters)
        values = {k: v for k, v in values.items() if k not in skip}
        return range_violations(self.spec.range_checks, values, daily)

    def unconstrain(self, values: Mapping[str, Any]) -> Params:
        """Inverse of [`constrain`][]; derived quantities in `values` are ignored.

        A time-varying parameter takes its coefficients' constrained values
        (`(coefficient[, patch])`, as `constrain` gives them) or one value
        (`()`, or `(patch,)` when per patch) that holds on every day.

        Raises:
            ValueError: for a concrete value (not traced) outside its
                parameter's range `[lower, upper]` (e.g. `beta = -1` for a
                `softplus` parameter), which has no unconstrained value.
        """
        self._check_params(values, "values")
        params: dict[str, Any] = {}
        for p in self.spec.parameters:
            params[p.name] = self._unconstrain(p, values[p.name])
        for n in self.spec.neural:
            params[n.name] = values[n.name]
        return params

    def _unconstrain(self, p, value: Any) -> Array:
        if p.per_time is None:
            check_range(p, self.spec.path, value)
            return unconstrain(p.transform, value, *p.bounds)
        full = jnp.ndim(value) == 1 + int(p.per_patch)
        if not full:
            check_range(p, self.spec.path, value)
            x = unconstrain(p.transform, value, *p.bounds)
            return self._constant_coefficients(p, x)
        if not isinstance(value, jax.core.Tracer):
            levels = level_mask(p.per_time, np.shape(value)[0])
            check_range(p, self.spec.path, np.asarray(value, np.float64)[levels])
        return unconstrain_coefficients(p, value)

    def free_mask(self, params: Params) -> PyTree[bool]:
        """Bools for `eqx.partition`: False for fixed parameters, for the
        non-array leaves (activation functions) of neural sub-models and for
        the hidden layers of one fixed `"hidden"`."""
        fixed = {p.name: p.fixed for p in self.spec.parameters}
        fixed |= {n.name: n.fixed for n in self.spec.neural}
        is_free = eqx.is_inexact_array
        mask = {}
        for name, leaf in params.items():
            how = fixed.get(name, False)
            if how == "hidden":
                mask[name] = output_layer_mask(leaf)
            else:
                mask[name] = jtu.tree_map(lambda x, h=how: not h and is_free(x), leaf)
        return mask

    # -- precomputation -------------------------------------------------------------
    def precompute(
        self,
        params: Params,
        covariates: Mapping[str, ArrayLike] | None = None,
        n_patches: int | None = None,
        n_days: int | None = None,
        scale: Mapping[str, ArrayLike] | None = None,
        breaks=None,
    ) -> tuple[Args, PiecewiseConstant | None]:
        """Everything that depends only on (parameters, day), once per solve.

        Args:
            params: unconstrained parameters (see [`init_params`][]).
            covariates: day-major arrays by name, e.g. `mobility (time, patch,
                feature)`, `coupling (time, patch, patch_to)`.

        Returns:
            `(args, inputs)`: `args` a dict of static rates, scales and matrices;
            `inputs` a `PiecewiseConstant` over the day grid (times
            `arange(n_days)` for the `floor` rule, minus 1/2 for `nearest`;
            the `breaks` days where given) holding per-day rates (e.g. an
            MLP's transmission rate `(time, patch)`) and raw coupling
            matrices, or `None` without time-varying covariates.

        With `n_patches`, scalar rates in `args` are broadcast to `(patch,)`
        here, once, so the reverse pass of a solver step forms no reduction
        per use of a scalar: the compiled gradient of a step is several times
        smaller (model README, "Scalar rates broadcast per patch").

        Time-varying parameters (`per_time`) are evaluated on every day
        (`daily_values`, times their `scale`) into `inputs`, over `n_days`
        days (the days solved; default the covariates' days, else the bound
        days) whose grid is the covariates' (the `floor` rule without
        time-varying covariates).

        `breaks` (concrete days from 0, e.g. `epifit.model.break_days` of
        the concrete covariates) evaluates the per-day inputs on those days
        only, each holding until the next, so the solver restarts only
        there; a covariate read that changes on another day raises a
        `ValueError` at run time, and differentiating with respect to the
        covariates gives each merged day's cotangent to its break day.
        """
        values = self.cell_values(params)
        arrays, _, n_cov = covariate_arrays(self.spec, params, covariates or {})
        daily = None
        if self.time_varying_parameters:
            n_cov = max(n_cov or 0, n_days or 0) or self._horizon()
            daily = self._on_cells(self.daily_values(params, n_cov, scale))
        return args_and_inputs(
            self.spec,
            self.plan,
            values,
            arrays,
            n_cov,
            n_patches,
            daily,
            breaks,
            self.days,
        )

    # -- the right-hand side --------------------------------------------------------
    def vector_field(self, t: Any, y: Y, args: Args, u: PyTree | None) -> Y:
        """`dy/dt`, state-dependent work only.

        Args:
            t: time (unused: time dependence enters through `u`).
            y: `{compartment: (stages, patch)}`.
            args: from [`precompute`][].
            u: one day's slice of `inputs.values` (or `None`).

        Returns:
            `dy`, with the structure and dtypes of `y`.
        """
        return right_hand_side(self.plan, self.compartments, t, y, args, u)

    @property
    def flow_keys(self) -> tuple[str, ...]:
        """The state entries that accumulate observed flows (`"S->E"`)."""
        return tuple(flow_key(e) for e in self.plan.flows)

    # -- initial state and observations ---------------------------------------------
    def initial_state(
        self,
        params: Params,
        data: Mapping[str, ArrayLike] | None,
        n_patches: int,
    ) -> Y:
        """`y0 = {compartment: (stages, patch)}` from the `[initial]` table.

        Expressions of parameters go to stage 1 (index 0); data variables have dims
        `(patch,)` (stage 1) or `(stage, patch)`; unlisted compartments start at 0.
        Each observed flow's accumulator (`flow_key`, `(1, patch)`) starts at 0.
        """
        y0 = initial_state_of(self.spec, self.cell_values(params), data, n_patches)
        if self.plan.flows:
            dtype = jnp.result_type(*jax.tree_util.tree_leaves(y0))
            for edge in self.plan.flows:
                y0[flow_key(edge)] = jnp.zeros((1, n_patches), dtype)
        return y0

    def observe(
        self,
        ys: Y,
        params: Params | None = None,
        covariates: Mapping[str, ArrayLike] | None = None,
        *,
        weekday: ArrayLike | None = None,
    ) -> dict[str, Array]:
        """The daily expected series of every observation from a trajectory.

        Args:
            ys: `{compartment (and flow accumulator): (time, stages, patch)}`.
            params: if given, each series goes through its reporting: delay,
                `ascertainment`, `scale` and week effect; without it the series
                are returned as the model computes them.
            covariates: the covariates an ascertainment or a scale reads
                (e.g. `population`, a testing volume).
            weekday: the day of the week of each save time (Monday 0), for
                observations with a week effect.

        Returns:
            `{data variable: (day, patch)}`: `(time, patch)` for prevalence;
            for incidence and flows `(time - 1, patch)`, row `k` the amount
            over day `k -> k + 1` (reported on day `k + 1`).
        """
        values = None if params is None else self.cell_values(params)
        dims = {c.name: c.dims for c in self.spec.covariates}
        out = {}
        for obs in self.spec.observations:
            series = quantity(obs, ys)
            if values is not None:
                series = report(
                    obs, series, values, covariates, dims, weekday, self._fail
                )
            if obs.strata == "sum":
                series = sum_strata(series, self.n_strata)
            out[obs.name] = series
        return out


def compile_model(spec: ModelSpec) -> CompiledModel:
    """Compile a validated spec; see [`CompiledModel`][]."""
    if not isinstance(spec, ModelSpec):
        raise TypeError(f"compile_model expects a ModelSpec, got {type(spec).__name__}")
    return CompiledModel(spec)


def as_model(model: str | os.PathLike | ModelSpec | CompiledModel) -> CompiledModel:
    """A compiled model from a TOML path, a spec or a compiled model."""
    if isinstance(model, CompiledModel):
        return model
    if isinstance(model, ModelSpec):
        return compile_model(model)
    if isinstance(model, str | os.PathLike):
        return compile_model(load_model(model))
    raise TypeError(
        "model must be a path to a TOML file, a ModelSpec or a CompiledModel; got "
        f"{type(model).__name__}."
    )
