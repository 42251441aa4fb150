"""Compilation of a `ModelSpec` to parameters, per-day inputs and a vector field."""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray, PyTree

from epifit._custom_types import Args, Params, Y
from epifit.model._coupling import SparseCoupling, coupled_mass
from epifit.model._errors import ModelSpecError
from epifit.model._load import load_model
from epifit.model._neural import make_mlp, neural_rates
from epifit.model._observation import predict
from epifit.model._once import computed_once
from epifit.model._plan import Infection, Plan, make_plan
from epifit.model._spec import CovariateSpec, ModelSpec, ObservationSpec
from epifit.model._transform import constrain, unconstrain
from epifit.ode import PiecewiseConstant

__all__ = ["CompiledModel", "as_model", "compile_model"]


def _rows(r: Array) -> Array:
    """A rate of shape `()` or `(patch,)`, ready to scale a `(stage, patch)` array."""
    return r if jnp.ndim(r) == 0 else r[None, :]


def _join(items) -> str:
    items = list(items)
    return ", ".join(items) if items else "(none)"


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

    def __init__(self, spec: ModelSpec):
        self.spec = spec
        self.plan = make_plan(spec)

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
        rules = {c.rule for c in self.spec.covariates if c.time_varying}
        return rules.pop() if rules else None

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
                spec order); default `jax.random.key(0)`.

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
            if p.per_patch:
                if value.ndim == 1 and value.size != n_patches:
                    raise self._fail(
                        f"parameters.{p.name}.value",
                        f"has {value.size} per-patch values but n_patches = "
                        f"{n_patches}",
                    )
                value = np.broadcast_to(value, (n_patches,))
            x = unconstrain(p.transform, jnp.asarray(value, float), *p.bounds)
            params[p.name] = x
        if self.spec.neural:
            key = jr.key(0) if key is None else key
            keys = jr.split(key, len(self.spec.neural))
            for k, n in zip(keys, self.spec.neural, strict=True):
                params[n.name] = make_mlp(n, key=k)
        return params

    def _check_params(self, params: Mapping[str, Any], what: str) -> None:
        expected = [p.name for p in self.spec.parameters]
        expected += [n.name for n in self.spec.neural]
        missing = [n for n in expected if n not in params]
        if missing:
            raise ValueError(
                f"{what} lacks {_join(missing)}; expected entries: {_join(expected)}"
            )

    def constrain(self, params: Params) -> dict[str, Any]:
        """Constrained parameter values, plus the derived quantities.

        Neural sub-models are passed through unchanged.
        """
        self._check_params(params, "params")
        out: dict[str, Any] = {}
        for p in self.spec.parameters:
            out[p.name] = constrain(p.transform, params[p.name], *p.bounds)
        for n in self.spec.neural:
            out[n.name] = params[n.name]
        derived = {d.name: d.expression for d in self.spec.derived}
        for name in self.plan.derived_order:
            out[name] = derived[name].evaluate(out)
        return out

    def unconstrain(self, values: Mapping[str, Any]) -> Params:
        """Inverse of [`constrain`][]; derived quantities in `values` are ignored."""
        self._check_params(values, "values")
        params: dict[str, Any] = {}
        for p in self.spec.parameters:
            params[p.name] = unconstrain(p.transform, values[p.name], *p.bounds)
        for n in self.spec.neural:
            params[n.name] = values[n.name]
        return params

    def free_mask(self, params: Params) -> PyTree[bool]:
        """Bools for `eqx.partition`: False for fixed parameters and for the
        non-array leaves (activation functions) of neural sub-models."""
        fixed = {p.name: p.fixed for p in self.spec.parameters}
        fixed |= {n.name: n.fixed for n in self.spec.neural}
        mask = {}
        for name, leaf in params.items():
            free = not fixed.get(name, False)
            mask[name] = jtu.tree_map(
                lambda x, free=free: free and eqx.is_inexact_array(x), leaf
            )
        return mask

    # -- precomputation -------------------------------------------------------------
    def _covariate_arrays(
        self, params: Mapping[str, Any], covariates: Mapping[str, ArrayLike]
    ) -> tuple[dict[str, Array], int | None, int | None]:
        """Check covariate shapes against their dims; return arrays, patches, days."""
        sizes: dict[str, tuple[int, str]] = {}

        def agree(dim: str, size: int, where: str) -> None:
            if dim in sizes and sizes[dim][0] != size:
                raise self._fail(
                    where,
                    f"{dim} size {size} disagrees with {dim} size {sizes[dim][0]} of "
                    f"{sizes[dim][1]}",
                )
            sizes.setdefault(dim, (size, where))

        for p in self.spec.parameters:
            if p.per_patch and p.name in params:
                agree(
                    "patch", int(jnp.shape(params[p.name])[0]), f"parameters.{p.name}"
                )
        in_sizes = {
            n.covariate: (n.in_size - int(n.time_input), n.name)
            for n in self.spec.neural
        }
        arrays = {}
        for c in self.spec.covariates:
            loc = f"covariates.{c.name}"
            if c.name not in covariates:
                raise self._fail(
                    loc,
                    f"no covariate {c.name!r} given; found: {_join(covariates)}",
                )
            a = covariates[c.name]
            if not isinstance(a, SparseCoupling):
                a = jnp.asarray(a)
            elif c.dims[-1] != "patch_to":
                raise self._fail(loc, "a sparse matrix is only a coupling covariate")
            if a.ndim != len(c.dims):
                raise self._fail(
                    loc,
                    f"shape {a.shape} does not match dims ({', '.join(c.dims)})",
                )
            for dim, size in zip(c.dims, a.shape, strict=True):
                if dim == "feature":
                    want, by = in_sizes[c.name]
                    if size != want:
                        raise self._fail(
                            loc,
                            f"shape {a.shape}: {size} features, but neural sub-model "
                            f"{by!r} takes {want}",
                        )
                elif dim == "patch_to":
                    agree("patch", size, loc)
                elif dim == "time" and size < 1:
                    raise self._fail(loc, f"shape {a.shape} has no days")
                else:
                    agree(dim, size, loc)
            arrays[c.name] = a
        n_patches = sizes["patch"][0] if "patch" in sizes else None
        n_days = sizes["time"][0] if "time" in sizes else None
        return arrays, n_patches, n_days

    def precompute(
        self,
        params: Params,
        covariates: Mapping[str, ArrayLike] | None = None,
        n_patches: int | None = None,
    ) -> tuple[Args, PiecewiseConstant | None]:
        """Everything that depends only on (parameters, day), once per solve.

        Args:
            params: unconstrained parameters (see [`init_params`][]).
            covariates: day-major arrays by name, e.g. `mobility (time, patch,
                feature)`, `coupling (time, patch, patch_to)`.

        Returns:
            `(args, inputs)`: `args` a dict of static rates, scales and matrices;
            `inputs` a `PiecewiseConstant` over the day grid (times
            `arange(n_days)` for the `floor` rule, minus 1/2 for `nearest`)
            holding per-day rates (e.g. an MLP's transmission rate `(time,
            patch)`) and raw coupling matrices, or `None` without time-varying
            covariates.

        With `n_patches`, scalar rates in `args` are broadcast to `(patch,)`
        here, once: a rate then enters the vector field elementwise, so the
        reverse pass of a solver step forms no reduction per use of a scalar
        (one reduction per solve instead, in this function's own reverse pass).
        That makes the compiled gradient of a step several times smaller.
        """
        values = self.constrain(params)
        arrays, _, n_days = self._covariate_arrays(params, covariates or {})
        static_env = dict(values)
        day_env: dict[str, Array] = {}
        for c in self.spec.covariates:
            if c.dims == ("patch",):
                static_env[c.name] = arrays[c.name]
            elif c.dims in (("time",), ("time", "patch")):
                day_env[c.name] = arrays[c.name]
        days = jnp.arange(n_days) if n_days is not None else None
        for n in self.spec.neural:
            day_env[n.name] = neural_rates(n, values[n.name], arrays[n.covariate], days)
        args: dict[str, Array] = {}
        per_day: dict[str, Array] = {}
        for s in self.plan.slots:
            if s.time_varying:
                names = {n for e in s.expressions for n in e.names} & day_env.keys()
                today = {n: day_env[n] for n in names}

                def evaluate(today, s=s):
                    return _slot_value(s, {**static_env, **today})

                per_day[s.key] = jax.vmap(evaluate)(today)
            else:
                value = _slot_value(s, static_env)
                if n_patches is not None and jnp.ndim(value) == 0:
                    value = jnp.broadcast_to(value, (n_patches,))
                args[s.key] = value
        for inf in self.plan.infections:
            c = inf.coupling
            if c is not None:
                m = arrays[c.covariate]
                if isinstance(m, SparseCoupling):
                    # the columns hold on every day; only the weights vary
                    args[c.matrix + ".columns"] = m.columns
                    m = m.values
                (per_day if c.time_varying else args)[c.matrix] = m
        if not per_day:
            return args, None
        times = np.arange(n_days, dtype=np.float64)
        if self.rule == "nearest":
            times = times - 0.5
        return args, PiecewiseConstant(times, per_day)

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
        get = _getter(args, u)
        loss: dict[str, list[Array]] = {c: [] for c in self.compartments}
        gain: dict[str, list[Array]] = {c: [] for c in self.compartments}
        chain: dict[str, Array] = {}
        for out in self.plan.outflows:
            x = y[out.compartment]
            rate = get(out.rate)
            flow = _rows(rate) * x  # (stage, patch): leaving each stage
            loss[out.compartment].append(flow)
            chain[out.compartment] = flow
            exit_ = flow[-1]
            taken = []
            for b in out.branches:
                if b.kind == "all":
                    f = exit_
                elif b.kind == "rate":
                    f = get(b.slot) * x[-1]
                elif b.kind == "probability":
                    f = get(b.slot) * exit_
                else:  # the remainder of a probability split
                    f = exit_ - _total(taken)
                taken.append(f)
                gain[b.target].append(f)
        for inf in self.plan.infections:
            lam = computed_once(functools.partial(self._force_from, inf), t, y, args, u)
            flow = _rows(lam) * y[inf.source]
            loss[inf.source].append(flow)
            gain[inf.target].append(flow.sum(axis=0) if flow.shape[0] > 1 else flow[0])
        dy = {}
        for name in self.compartments:
            x = y[name]
            lost = _total(loss[name])
            if gain[name]:
                first = _total(gain[name])[None, :]
            elif x.shape[0] == 1 and lost is not None:
                dy[name] = (-lost).astype(x.dtype)
                continue
            else:
                first = jnp.zeros_like(x[:1])
            if x.shape[0] > 1:
                rest = chain[name][:-1] if name in chain else jnp.zeros_like(x[1:])
                d = jnp.concatenate([first, rest], axis=0)
            else:
                d = first
            if lost is not None:
                d = d - lost
            dy[name] = d.astype(x.dtype)
        return dy

    def _force_from(self, inf: Infection, y: Y, args: Args, u) -> Array:
        return self._force(inf, y, _getter(args, u))

    def _force(self, inf: Infection, y: Y, get) -> Float[Array, " patch"]:
        i = None
        for s in inf.sources:
            x = y[s.compartment]
            sel = s.selection
            if sel is None:
                m = x.sum(axis=0) if x.shape[0] > 1 else x[0]
            elif len(sel) == 1:
                m = x[sel[0]]
            elif sel == tuple(range(sel[0], sel[-1] + 1)):
                m = x[sel[0] : sel[-1] + 1].sum(axis=0)
            else:
                m = x[np.asarray(sel)].sum(axis=0)
            if s.weight is not None:
                m = get(s.weight) * m
            i = m if i is None else i + m
        if inf.population is not None:
            i = i / get(inf.population)
        c = inf.coupling
        if c is None:
            force = i
        else:
            coupled = coupled_mass(
                i,
                _matrix(get(c.matrix), _optional(get, c.matrix + ".columns")),
                None if c.scale is None else get(c.scale),
                symmetrize=c.symmetrize,
                multiplier=c.multiplier,
            )
            if c.local == 0.0:
                force = coupled
            elif c.local == 1.0:
                force = i + coupled
            else:
                force = c.local * i + coupled
        return get(inf.transmission) * force

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
        """
        data = {} if data is None else data
        env = dict(self.constrain(params))
        for c in self.spec.covariates:
            if c.dims == ("patch",) and c.name in data:
                env[c.name] = jnp.asarray(data[c.name])
        dtype = jnp.result_type(float)
        initial = {i.compartment: i for i in self.spec.initial}
        y0 = {}
        for comp in self.spec.compartments:
            shape = (comp.stages, n_patches)
            spec = initial.get(comp.name)
            loc = f"initial.{comp.name}"
            if spec is None:
                y0[comp.name] = jnp.zeros(shape, dtype)
                continue
            if spec.expression is not None:
                missing = [n for n in spec.expression.names if n not in env]
                if missing:
                    raise self._fail(
                        loc, f"data lacks {_join(missing)}; found: {_join(data)}"
                    )
                v = spec.expression.evaluate(env)
                first = jnp.broadcast_to(v, (n_patches,)).astype(dtype)
            else:
                if spec.data not in data:
                    raise self._fail(
                        loc, f"no data variable {spec.data!r}; found: {_join(data)}"
                    )
                a = jnp.asarray(data[spec.data], dtype)
                if a.shape == shape:
                    y0[comp.name] = a
                    continue
                if a.shape != (n_patches,):
                    raise self._fail(
                        loc,
                        f"data variable {spec.data!r} has shape {a.shape}; expected "
                        f"(patch,) = ({n_patches},) or (stage, patch) = {shape}",
                    )
                first = a
            rest = jnp.zeros((comp.stages - 1, n_patches), dtype)
            y0[comp.name] = jnp.concatenate([first[None, :], rest], axis=0)
        return y0

    def observe(
        self,
        ys: Y,
        params: Params | None = None,
        covariates: Mapping[str, ArrayLike] | None = None,
    ) -> dict[str, Array]:
        """Predicted series for every observation from a trajectory.

        Args:
            ys: `{compartment: (time, stages, patch)}`.
            params: if given, each series is multiplied by its `ascertainment`
                and `scale`; without it the series are returned as the model
                computes them.
            covariates: the `(patch,)` covariates a `scale` uses (e.g.
                `population`).

        Returns:
            `{data variable: (time, patch)}` for prevalence, `(time - 1, patch)`
            for incidence.
        """
        values = None if params is None else self.constrain(params)
        out = {}
        for obs in self.spec.observations:
            series = predict(obs, ys)
            if values is not None and obs.ascertainment is not None:
                series = _rows(obs.ascertainment.evaluate(values)) * series
            if values is not None and obs.scale is not None:
                env = dict(values)
                for n in obs.scale.names:
                    if n not in env:
                        if covariates is None or n not in covariates:
                            raise self._fail(
                                f"observations.{obs.name}.scale",
                                f"needs the covariate {n!r}; pass covariates",
                            )
                        env[n] = jnp.asarray(covariates[n])
                series = _rows(obs.scale.evaluate(env)) * series
            out[obs.name] = series
        return out


def _getter(args: Args, u: PyTree | None):
    def get(key: str) -> Array:
        return u[key] if u is not None and key in u else args[key]

    return get


def _optional(get, key: str):
    try:
        return get(key)
    except KeyError:
        return None


def _matrix(m: Array, columns: Array | None):
    """A coupling matrix: dense, or one day's sparse rows with their columns."""
    return m if columns is None else SparseCoupling(m, columns)


def _total(terms: list[Array]) -> Array | None:
    """Sum of a list of arrays (no `0 +` start as with `sum`), or None if empty."""
    if not terms:
        return None
    out = terms[0]
    for term in terms[1:]:
        out = out + term
    return out


def _slot_value(slot, env: Mapping[str, Any]) -> Array:
    total = None
    for e in slot.expressions:
        v = e.evaluate(env)
        total = v if total is None else total + v
    if slot.factor != 1.0:
        total = slot.factor * total
    return total


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
