"""What a scenario change binds to (the model, its data and the horizon) and
what a bound change writes (one scenario's arrays)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from epifit._toml import join
from epifit.forecasting._error import ScenarioError
from epifit.forecasting._horizon import Horizon
from epifit.model import CompiledModel, kron_operands

__all__ = ["BindContext", "ScenarioArrays", "list_labels"]


def list_labels(items: Sequence[str], limit: int = 20) -> str:
    """Labels for an error message, the first `limit` of them."""
    items = [str(x) for x in items]
    return join(items if len(items) <= limit else items[:limit] + ["..."])


@dataclasses.dataclass(frozen=True)
class BindContext:
    """The model, data and horizon that changes are checked against, with the
    lookups their checks share.

    Attributes:
        model: the compiled model.
        patches: the patch labels, in order.
        covariates: the data's covariates by name (`(time, ...)` day-major).
        values: constrained parameter values (the point estimate).
        horizon: the days.
        feature_labels: labels of a covariate's feature axis, when the data
            have them.
        file: the scenario file, for error messages (or `None`).
    """

    model: CompiledModel
    patches: tuple[str, ...]
    covariates: Mapping[str, Any]
    values: Mapping[str, Any]
    horizon: Horizon
    feature_labels: Mapping[str, Sequence[str]]
    file: str | None

    @classmethod
    def of(cls, model, patches, covariates, values, horizon, feature_labels, file):
        return cls(
            model=model,
            patches=tuple(str(p) for p in patches),
            covariates=covariates,
            values=values,
            horizon=horizon,
            feature_labels=dict(feature_labels or {}),
            file=file,
        )

    @property
    def spec(self):
        return self.model.spec

    @property
    def time_varying(self) -> list[str]:
        """The names of the model's time-varying covariates, sorted."""
        return sorted(c.name for c in self.spec.covariates if c.time_varying)

    def fail(self, loc: str, reason: str) -> ScenarioError:
        return ScenarioError(reason, file=self.file, location=loc)

    def select(self, labels: Sequence[str], loc: str) -> np.ndarray:
        """`(patch,)`: the patches named in `labels` (listed at `loc`)."""
        index = {p: k for k, p in enumerate(self.patches)}
        mask = np.zeros(len(self.patches), bool)
        for k, lab in enumerate(labels):
            if lab not in index:
                raise self.fail(
                    f"{loc}[{k}]",
                    f"unknown patch {lab!r}; the data's {len(self.patches)} "
                    f"patches: {list_labels(self.patches)}",
                )
            mask[index[lab]] = True
        return mask

    def patch_mask(self, patches: Sequence[str] | None, loc: str) -> np.ndarray:
        """`(patch,)`: the patches a change names at `loc`, or all of them."""
        if patches is None:
            return np.ones(len(self.patches), bool)
        return self.select(patches, f"{loc}.patches")

    @property
    def n_cells(self) -> int:
        """The structure axis of the model's state: the patches, or with
        `[strata]` the cells (patch x stratum, patch-major)."""
        return len(self.patches) * self.model.n_strata

    def cells(self, mask: np.ndarray, covariate: str | None = None) -> np.ndarray:
        """A `(patch,)` mask on the structure axis of the state (or of
        `covariate`): with `[strata]` every stratum of each patch, `(cell,)`;
        the matrix over patches of a `kron(M, C)` coupling stays on patches."""
        if self.model.n_strata == 1 or covariate in kron_operands(self.spec):
            return mask
        return np.repeat(mask, self.model.n_strata)


@dataclasses.dataclass
class ScenarioArrays:
    """One scenario's arrays (NumPy), written by its bound changes in turn.

    Attributes:
        covariates: every covariate over the horizon (`(time, ...)`).
        parameters: per changed parameter, `scale` and `value` (NaN: keep) on
            the intervals between parameter-change days, `(interval, *shape)`.
        transmission: `scale` and `value` (NaN: keep), `(time, patch)`.
        interval_starts: `(interval,)` the first day of each interval.
    """

    covariates: dict[str, Any]
    parameters: dict[str, dict[str, np.ndarray]]
    transmission: dict[str, np.ndarray]
    interval_starts: np.ndarray
