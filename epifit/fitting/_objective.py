"""The one objective of a fit: what calibration, uncertainty and the adjoint
audit differentiate.

[`Objective`][] is the negative log-likelihood of the observations plus the
free parameters' negative log-priors and L2 penalties, as a function of the
flat free vector `x` (see `FreeParameters`), with everything the fitting layer
needs of it: value and gradient, least-squares residuals and their Jacobian,
Hessians, the solve at a point, and compiled methods batched over starting
points. `data` holds the problem's arrays and the fixed parameter leaves,
passed to compiled functions as traced arguments (never closed over).

Solves in the free-vector methods run with `throw=False`: a failed solve gives
a non-finite loss, which the optimiser rejects and retreats from, instead of an
exception in the middle of a compiled loop.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from epifit._stored import stored
from epifit._vmap import default_group, vmap_batch
from epifit.data import (
    AbstractObservationModel,
    Gaussian,
    NegativeBinomial,
    Normal,
    Poisson,
)
from epifit.fitting._parameters import FreeParameters
from epifit.model import ObservationSpec
from epifit.ode import forward_mode, jacobian
from epifit.simulation import Problem, SolverSettings

__all__ = ["FAMILIES", "FORWARD_MAX_PARAMETERS", "FORWARD_MAX_WORK",
           "HESSIAN_MAP_MAX_WORK", "Objective", "observation_model"]  # fmt: skip

FORWARD_MAX_PARAMETERS = 16
FORWARD_MAX_WORK = 64
"""Derivatives in forward mode where the free parameters number at most
`FORWARD_MAX_PARAMETERS` and their count times the model's state size is at
most `FORWARD_MAX_WORK` (see `Objective.forward_pays`)."""
HESSIAN_MAP_MAX_WORK = 65536
"""`data_hessian` forward over reverse one Hessian-vector product at a time
(`lax.map`) up to this many free parameters x states, batched (`vmap`)
above (see `Objective.data_hessian`)."""

FAMILIES: dict[str, type[AbstractObservationModel]] = {
    "least_squares": Gaussian,
    "gaussian": Normal,
    "poisson": Poisson,
    "negative_binomial": NegativeBinomial,
}
"""Likelihood family names, as model files write them."""


def _family(obs: ObservationSpec) -> type[AbstractObservationModel]:
    if obs.family not in FAMILIES:
        raise ValueError(f"observation '{obs.name}': unknown family '{obs.family}'.")
    return FAMILIES[obs.family]


def observation_model(obs: ObservationSpec, values) -> AbstractObservationModel:
    """The likelihood of one observation, from its spec and the constrained
    parameter `values` (a negative binomial reads its dispersion there, a
    gaussian evaluates its `sd` expression there); the observation's `weight`
    multiplies its loss. `least_squares` is `Gaussian(weight=w)` (a weighted
    sum of squares), `gaussian` is `Normal(sd, weight=w)` (a true normal
    log-likelihood, `sd` scalar or per patch, broadcast over the stamps)."""
    family = _family(obs)
    if family is Normal:
        if obs.sd is None:
            raise ValueError(
                f"observation '{obs.name}': family gaussian needs a standard "
                "deviation (sd = 'EXPR')."
            )
        sd = jnp.asarray(obs.sd.evaluate(values))
        return Normal(sd[None, :] if sd.ndim == 1 else sd, weight=obs.weight)
    if issubclass(family, NegativeBinomial):
        if obs.dispersion is None:
            raise ValueError(
                f"observation '{obs.name}': family negative_binomial needs a "
                "dispersion parameter (dispersion = 'name')."
            )
        return NegativeBinomial(values[obs.dispersion], weight=obs.weight)
    return family(weight=obs.weight)


class Objective:
    """Loss, residuals and their derivatives for a problem and its free
    parameters, solved with one `SolverSettings`.

    The loss is the sum of the observation losses (each observation model
    applies its weight: a weighted sum of squares for least_squares
    observations, `weight` times the negative log-likelihood for gaussian,
    poisson and negative binomial ones; missing points masked) plus the
    parameters' negative log-priors and L2 penalties. `log_likelihood` is the
    observations' log-likelihood itself (unweighted, see there), without
    priors or penalties: what AIC and BIC use.

    Cost model: every value costs one solve of the model; `value_and_grad` one
    solve and one adjoint pass (the settings' adjoint); the Jacobian of the
    residuals one forward-sensitivity solve with `n` directions; the Hessian
    forward over reverse mode, `n` gradient passes (forward over forward,
    one solve with `n²` tangents, where `forward_pays`). `compiled(name)`
    compiles a method once per objective, batched over starting points.

    Args:
        problem: the model bound to its data (with observations).
        free: the free parameters, their priors and penalties.
        settings: how every solve runs (default `SolverSettings()`).

    Attributes:
        settings: the solver settings of every solve.
        families: observation name -> its likelihood family (a class).
        gaussian_data: every observation is least_squares (a weighted sum of
            squares; a `gaussian` observation with its `sd` is not: its loss
            has a `log(sd)` term). The name is historical.
        least_squares: every observation is least_squares and every prior
            normal, so the loss is `sum(residuals(x) ** 2)`.
        n_data: the number of observed (unmasked) points the loss sums over.
        group: starting points batched together by the compiled methods
            (`vmap_batch`'s `group`; default `default_group()`: one at a time
            on CPU, all together elsewhere).

    Raises:
        DataError: an observation the model declares is missing from the data,
            or holds no finite value (see `Problem.require_observations`).
    """

    def __init__(
        self,
        problem: Problem,
        free: FreeParameters,
        settings: SolverSettings | None = None,
    ):
        self.problem = problem
        self.free = free
        self.settings = SolverSettings.of(settings)
        problem.require_observations()
        self.observations = list(problem.spec.observations)
        # starts batched together by the compiled methods (see `default_group`)
        self.group = default_group()
        self.families = {o.name: _family(o) for o in self.observations}
        self.gaussian_data = all(o.family == "least_squares" for o in self.observations)
        self.least_squares = self.gaussian_data and free.least_squares_penalty
        self.n_data = sum(_n_observed(problem, o) for o in self.observations)

    # -- data -------------------------------------------------------------------
    def data(self) -> dict:
        """The traced data of every compiled call: arrays and fixed leaves."""
        return {"arrays": self.problem.arrays, "rest": self.free.rest}

    def params(self, x, data):
        return self.free.params(x, data["rest"])

    def predictions(self, x, data, *, throw: bool = False):
        params = self.params(x, data)
        sol = self.problem.solve(
            params, self.settings, arrays=data["arrays"], throw=throw
        )
        return params, sol, self.problem.predict(params, sol.ys, data["arrays"])

    # -- loss ---------------------------------------------------------------------
    def _observation_loss(self, params, pred, arrays, dtype):
        """The summed observation losses, from a zero of `dtype`."""
        values = self.problem.model.constrain(params)
        total = jnp.zeros((), dtype)
        for o in self.observations:
            p, y, m = pred[o.name], arrays["observed"][o.name], arrays["mask"][o.name]
            total = total + observation_model(o, values).loss(p, y, m)
        return total

    def _log_likelihood(self, params, pred, arrays, dtype):
        """The observations' summed log-likelihood (no weights), from a zero
        of `dtype`."""
        values = self.problem.model.constrain(params)
        total = jnp.zeros((), dtype)
        for o in self.observations:
            p, y, m = pred[o.name], arrays["observed"][o.name], arrays["mask"][o.name]
            total = total + observation_model(o, values).log_likelihood(p, y, m)
        return total

    def log_likelihood(self, x, data):
        """The log-likelihood of the observations at free vector `x`: the sum
        over observations of each family's `log_likelihood`. Unweighted: the
        `weight` of a gaussian, poisson or negative binomial observation
        scales its loss, not this; a least_squares observation's weight is
        its noise precision, so this is the normal density of sd
        `sqrt(1 / (2 weight))` there. Priors and penalties do not enter.
        One solve."""
        params, _, pred = self.predictions(x, data)
        return self._log_likelihood(params, pred, data["arrays"], self.free.x0.dtype)

    def log_likelihood_at(self, x, ys, data):
        """`log_likelihood(x, data)` from the states `ys` of a solve already
        made at `x` (no solve: the predictions and the sum only)."""
        params = self.params(x, data)
        pred = self.problem.predict(params, ys, data["arrays"])
        return self._log_likelihood(params, pred, data["arrays"], self.free.x0.dtype)

    def data_loss(self, x, data):
        """The observation part of the loss (the negative log-likelihood)."""
        params, _, pred = self.predictions(x, data)
        return self._observation_loss(params, pred, data["arrays"], self.free.x0.dtype)

    def penalty(self, x, data):
        """The negative log-prior plus the L2 penalties (no solve)."""
        return self.free.penalty(x, data["rest"])

    def loss(self, x, data):
        """The total loss at free vector `x`."""
        params, _, pred = self.predictions(x, data)
        nll = self._observation_loss(params, pred, data["arrays"], self.free.x0.dtype)
        return nll + self.free.penalty(x, data["rest"])

    def value_and_grad(self, x, data):
        return jax.value_and_grad(self.loss)(x, data)

    @property
    def forward_pays(self) -> bool:
        """Whether derivatives over the free vector are cheaper in forward
        mode (one solve carrying a tangent per free parameter, no backward
        pass) than by the solver settings' adjoint: only with the default
        adjoint (a fit file's `adjoint` is obeyed), at most
        `FORWARD_MAX_PARAMETERS` (16) free parameters, and free parameters
        times states at most `FORWARD_MAX_WORK` (64). The sampler's
        gradient (`epifit.sampling`) and `data_hessian` follow it.

        Measured per `value_and_grad` of the objective (float64, `epifit.jit`,
        one process): boarding-school SIR, 3 parameters x 3 states, 0.13 ms
        forward against 0.24 ms reverse (checkpoint); SEIR 4 x 4: 0.11
        against 0.18 ms; SEIRD box-car 6 x 16: 0.15 against 0.17 ms (about a
        tie); the 20-patch metapopulation 3 x 320: 12.0 against 10.0 ms
        (reverse wins), 23 x 320: 50 against 10.4 ms. The Hessian of the
        SIR: compiled in 1.76-1.81 s forward over forward against 2.29-2.33
        s forward over reverse, evaluated in 0.5-0.8 against 2.5-3.5 ms."""
        if self.settings.adjoint is not None:
            return False
        n = self.free.n
        return (
            n <= FORWARD_MAX_PARAMETERS
            and n * self.problem.n_states <= FORWARD_MAX_WORK
        )

    def data_hessian(self, x, data):
        """The Hessian of `data_loss`: forward over forward mode where
        `forward_pays` (one solve carrying `n²` second-order tangents; its
        step-size control differentiated too, as `epifit.ode.jacobian`
        does), else forward over reverse mode (the adjoint's pull-back
        differentiated), column by column.

        Forward over reverse is `jvp` of the gradient along each unit vector:
        up to `HESSIAN_MAP_MAX_WORK` free parameters x states one product at
        a time in a `lax.map` (the solve and its adjoint not batched over
        tangents), above it batched (`vmap`, `jax.jacfwd`). Measured on the
        20-patch counts model (199 x 320; float64, rtol 1e-5, lowering +
        compile + evaluation, two processes each, 2026-12-06): one at a time
        1.1 + 6.0-6.1 + 2.6-2.9 s against 2.3-2.8 + 7.6-9.3 + 1.7 s batched
        (`jax.hessian`): 2-3.6 s sooner, the evaluation about 5 ms a column
        dearer, which grows with the model, hence the bound. In a cold
        `epifit calibrate` of that model (50 iterations, then the Laplace
        step, whose evaluation at the fitted point takes longer) the wall
        was 23.5 and 23.9 s one at a time against 24.0 and 25.0 s in one
        batch of 199 and 24.8 and 25.3 s in a `lax.map` of batches of 16
        (alternating). The columns are those of
        `jax.jacfwd(jax.grad(...))` to 1e-14; `jax.hessian`'s (forward over
        `jax.jacrev`, whose pull-back is batched over one cotangent) differ
        by 2e-4 of the largest entry there, within the solve's own error
        (the matrix is asymmetric by 1.5e-3 at that tolerance; the Laplace
        approximation symmetrises it)."""
        if self.forward_pays:
            with forward_mode():
                return jax.jacfwd(jax.jacfwd(self.data_loss))(x, data)
        if not self.hessian_by_columns:
            return jax.jacfwd(jax.grad(self.data_loss))(x, data)
        return self.hessian_columns(x, jnp.eye(self.free.n, dtype=x.dtype), data).T

    @property
    def hessian_by_columns(self) -> bool:
        """Whether `data_hessian` is forward over reverse one Hessian-vector
        product at a time (`hessian_columns`; see `data_hessian`)."""
        n_work = self.free.n * self.problem.n_states
        return not self.forward_pays and n_work <= HESSIAN_MAP_MAX_WORK

    def hessian_columns(self, x, vectors, data):
        """`H v` of `data_loss` for each row `v` of `vectors (k, n)`, forward
        over reverse mode one product at a time (`lax.map`): `(k, n)`. On a
        CPU with several cores the Laplace step splits the unit vectors
        between threads, each evaluating this program on its block."""

        def column(v):
            return jax.jvp(lambda x: jax.grad(self.data_loss)(x, data), (x,), (v,))[1]

        return jax.lax.map(column, vectors)

    def penalty_hessian(self, x, data):
        """The Hessian of `penalty`."""
        return jax.hessian(self.penalty)(x, data)

    def params_loss(self, params, arrays):
        """The observation loss at an unconstrained parameter pytree, to
        differentiate with respect to every inexact leaf, fixed ones included
        (the adjoint audit). The solve raises `SolverError` on failure."""
        sol = self.problem.solve(params, self.settings, arrays=arrays)
        pred = self.problem.predict(params, sol.ys, arrays)
        return self._observation_loss(params, pred, arrays, self.problem.dtype)

    # -- least squares --------------------------------------------------------------
    def _check_gaussian(self) -> None:
        if not self.gaussian_data:
            bad = [o for o in self.observations if o.family != "least_squares"]
            raise NotImplementedError(
                "Least-squares methods need least_squares observations; "
                + ", ".join(f"'{o.name}' is {o.family}" for o in bad)
                + ". Use the lbfgs or adam optimisers (and uncertainty method "
                "'hessian')."
            )

    def _data_residuals(self, pred, data):
        arrays = data["arrays"]
        parts = []
        for o in self.observations:
            p, y, m = pred[o.name], arrays["observed"][o.name], arrays["mask"][o.name]
            m = m & jnp.isfinite(y)
            r = jnp.sqrt(jnp.asarray(o.weight, p.dtype)) * (p - jnp.where(m, y, p))
            parts.append(jnp.ravel(jnp.where(m, r, 0.0)))
        return jnp.concatenate(parts)

    def _residuals(self, x, pred, data):
        return jnp.concatenate(
            [
                self._data_residuals(pred, data),
                self.free.penalty_residuals(x, data["rest"]),
            ]
        )

    @property
    def n_data_rows(self) -> int:
        """The length of the data residual vector (masked points included)."""
        return sum(self.problem.observed[o.name].size for o in self.observations)

    def data_residuals(self, x, data):
        """`sqrt(weight) * (predicted - observed)` at every point, 0 where masked."""
        self._check_gaussian()
        _, _, pred = self.predictions(x, data)
        return self._data_residuals(pred, data)

    def residuals(self, x, data):
        """All residuals: `loss(x) == sum(residuals(x) ** 2)` for least squares;
        the first `n_data_rows` are the data's, the rest the priors'/penalties'."""
        self._check_gaussian()
        _, _, pred = self.predictions(x, data)
        return self._residuals(x, pred, data)

    def jacobian_and_solution(self, x, data):
        """`(r, dr/dx, ys, stats, result)`: residuals, their Jacobian (forward
        sensitivities) and the solve they came from."""
        self._check_gaussian()

        def fn(x):
            _, sol, pred = self.predictions(x, data)
            r = self._residuals(x, pred, data)
            return r, (r, sol.ys, sol.stats, sol.result)

        J, (r, ys, stats, result) = jacobian(fn, has_aux=True)(x)
        return r, J, ys, stats, result

    def residuals_and_jacobian(self, x, data):
        """`(r, dr/dx)` with forward-mode sensitivities of the solve."""
        r, J, *_ = self.jacobian_and_solution(x, data)
        return r, J

    def solution(self, x, data):
        """`(ys, stats, result)` of the solve at `x` (no derivatives)."""
        _, sol, _ = self.predictions(x, data)
        return sol.ys, sol.stats, sol.result

    # -- compiled, batched over starts ---------------------------------------------
    def __getstate__(self) -> dict:
        """The objective without its compiled programs (`compiled`, the fit's
        output program): a pickled objective (a sampler's worker process) is
        plain data and compiles its own."""
        return {k: v for k, v in self.__dict__.items() if k not in _CACHES}

    def compiled(self, name: str):
        """`jit(vmap(method))` over a batch of `x` (in groups of `group` points),
        compiled once per objective (and, within `epifit calibrate`, kept
        across runs with the same inputs, so that a warm run does not trace
        it again; its outputs are tuples, dicts and arrays)."""
        cache = self.__dict__.setdefault("_compiled", {})
        if name not in cache:
            method = getattr(self, name)
            batched = vmap_batch(method, in_axes=(0, None), group=self.group)
            cache[name] = stored(f"objective {name}", batched, out_tree=None)
        return cache[name]


_CACHES = ("_compiled", "_output")  # see `Objective.__getstate__`


def _n_observed(problem: Problem, obs: ObservationSpec) -> int:
    """The observed (unmasked, not NaN) points of one observation that the loss
    sums over."""
    m = np.asarray(problem.mask[obs.name]) & ~np.isnan(
        np.asarray(problem.observed[obs.name])
    )
    return int(m.sum())
