"""The one model solve: a compiled model run on bound data.

Every solve of a model on data (`Problem.solve`, the synthetic generator, the
forecast ensemble) goes through [`ModelRun`][]: the initial state from the
parameters and the initial data, `model.precompute`, then `epifit.ode.solve`
with the solver settings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from epifit.model import CompiledModel
from epifit.ode import PiecewiseConstant, Solution, solve
from epifit.simulation._settings import SolverSettings

__all__ = ["ModelRun"]


@dataclasses.dataclass(frozen=True)
class ModelRun:
    """How one compiled model is solved: the save grid, the sizes, the solver.

    Calling it runs the three steps in order; a caller that builds its own
    `(args, inputs)` (the forecast ensemble, which precomputes once per
    scenario interval) calls the steps one by one. Nothing here is compiled:
    the caller jits (covariates and initial data enter as traced arguments).

    Cost: one `model.precompute` (the per-day rates, vectorised over days)
    and one segment-wise solve over `ts`.

    Attributes:
        model: the compiled model.
        ts: the save times, `(time,)` float days (`t = 0` on the first day).
        n_patches: the number of patches.
        dtype: the state's floating dtype (the initial state is cast to it).
        settings: the solver settings.
        broadcast_rates: `precompute` broadcasts scalar rates to `(patch,)`
            (the layout whose gradient is cheap, see `CompiledModel.precompute`);
            `False` keeps them scalar, as the synthetic generator's forward-only
            solve does.
        breaks: the days on which the per-day inputs can change (concrete,
            from 0; `epifit.model.break_days`, which `Problem` computes from
            its covariates): `precompute` evaluates them there only and the
            solver restarts there only. `None` (the forecast ensemble, the
            synthetic generator) keeps the daily grid.
    """

    model: CompiledModel
    ts: np.ndarray
    n_patches: int
    dtype: Any
    settings: SolverSettings = dataclasses.field(default_factory=SolverSettings)
    broadcast_rates: bool = True
    breaks: tuple[int, ...] | None = None

    def initial_state(
        self,
        params,
        data: Mapping[str, Any] | None,
        covariates: Mapping[str, Any] | None = None,
    ):
        """`y0 = {compartment: (stage, patch)}` from the parameters, the
        initial data and the `(patch,)` covariates an `[initial]` expression
        may read (a `population`; `CompiledModel.initial_state`), in `dtype`."""
        static = {
            c.name: covariates[c.name]
            for c in self.model.spec.covariates
            if covariates is not None
            and c.name in covariates
            and not c.time_varying
            and c.dims[-1:] != ("patch_to",)
        }
        y0 = self.model.initial_state(
            params, {**static, **(data or {})}, self.n_patches
        )
        return {k: v.astype(self.dtype) for k, v in y0.items()}

    def precompute(
        self,
        params,
        covariates: Mapping[str, Any] | None,
        scale: Mapping[str, Any] | None = None,
    ) -> tuple[Any, PiecewiseConstant | None]:
        """`(args, inputs)`: what depends only on (parameters, day), once
        (`scale`: factors of time-varying parameters' daily values)."""
        n = self.n_patches if self.broadcast_rates else None
        days = int(np.floor(self.ts[-1])) + 1 if len(self.ts) else None
        return self.model.precompute(
            params, covariates, n, days, scale=scale, breaks=self.breaks
        )

    def integrate(
        self, y0, args, inputs: PiecewiseConstant | None, *, throw: bool = True
    ) -> Solution:
        """`epifit.ode.solve` of the model's vector field over `ts`."""
        return solve(
            self.model.vector_field,
            y0,
            args,
            ts=self.ts,
            inputs=inputs,
            throw=throw,
            **self.settings.solve_kwargs(),
        )

    def __call__(
        self,
        params,
        covariates: Mapping[str, Any] | None,
        initial: Mapping[str, Any] | None,
        *,
        throw: bool = True,
    ) -> Solution:
        """Solve at `params` (unconstrained) with these covariates and initial
        data: `initial_state`, `precompute`, `integrate`."""
        y0 = self.initial_state(params, initial, covariates)
        args, inputs = self.precompute(params, covariates)
        return self.integrate(y0, args, inputs, throw=throw)
