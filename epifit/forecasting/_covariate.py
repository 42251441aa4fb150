"""Covariate changes: scale or replace a time-varying covariate, or part of
it (features and patches, or the inflow and outflow of a coupling), and the
covariate arrays they act on (dense NumPy or `SparseCoupling`)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, final

import numpy as np

from epifit._toml import at, join
from epifit.data import FEATURE, PATCH, PATCH_TO
from epifit.forecasting._change import AbstractChange, check_name
from epifit.forecasting._context import BindContext, ScenarioArrays, list_labels
from epifit.forecasting._horizon import carry_forward
from epifit.model import SparseCoupling, kron_operands

__all__ = ["CovariateChange", "host_covariate"]


def host_covariate(v: Any, n_days: int | None) -> np.ndarray | SparseCoupling:
    """A covariate as NumPy (a `SparseCoupling` keeps its storage), carried
    forward over `n_days` when it varies in time."""
    if isinstance(v, SparseCoupling):
        values = np.asarray(v.values)
        if n_days is not None:
            values = carry_forward(values, n_days)
        return SparseCoupling(values, np.asarray(v.columns))
    a = np.asarray(v)
    return a if n_days is None else carry_forward(a, n_days)


def _links(v: np.ndarray | SparseCoupling) -> np.ndarray:
    """`(patch, patch_to)`: the entries of a coupling that are non-zero on
    some day (the existing links)."""
    if isinstance(v, SparseCoupling):
        n = v.columns.shape[0]
        out = np.zeros((n, n), bool)
        nonzero = np.any(v.values != 0, axis=tuple(range(v.values.ndim - 2)))
        rows = np.broadcast_to(np.arange(n)[:, None], v.columns.shape)
        out[rows[nonzero], v.columns[nonzero]] = True
        return out
    return np.any(v != 0, axis=tuple(range(v.ndim - 2)))


@final
@dataclasses.dataclass(frozen=True)
class CovariateChange(AbstractChange):
    """Scale or replace a time-varying covariate, or part of it: chosen
    `features` and `patches` of `mobility (time, patch, feature)`; the
    `inflow` and/or `outflow` of `coupling (time, patch, patch_to)`.

    Attributes:
        covariate: a time-varying covariate of the model, e.g. `"mobility"`.
        features: feature indices (or labels) of a covariate with a feature
            axis; default all.
        inflow: patch labels whose coupling *rows* change (the pressure of
            infection reaching them from elsewhere; with `[strata]`, the rows
            of all their strata).
        outflow: patch labels whose coupling *columns* change (what their
            infectious add elsewhere). With both, the entries in either change.
            A `value` for a coupling replaces the weights of existing links
            (entries non-zero on some day of the data) and creates none.
    """

    covariate: str
    features: tuple[int | str, ...] | None = dataclasses.field(
        default=None, kw_only=True
    )
    inflow: tuple[str, ...] | None = dataclasses.field(default=None, kw_only=True)
    outflow: tuple[str, ...] | None = dataclasses.field(default=None, kw_only=True)

    table_fields: ClassVar[tuple[str, ...]] = (
        "covariate",
        "scale",
        "value",
        "start",
        "end",
        "patches",
        "features",
        "inflow",
        "outflow",
    )
    list_fields: ClassVar[tuple[str, ...]] = (
        "patches",
        "inflow",
        "outflow",
        "features",
    )

    @property
    def target(self) -> str:
        return f"covariate {self.covariate!r}"

    def _check_target(self, file: str | None, loc: str) -> None:
        check_name(self.covariate, file, at(loc, "covariate"))

    def bind(self, ctx: BindContext, loc: str) -> np.ndarray:
        dims = self._dims(ctx, loc)
        shape = tuple(ctx.covariates[self.covariate].shape)[1:]
        if PATCH_TO in dims:
            return self._coupling_entries(ctx, loc, shape)
        axes = []
        for dim, size in zip(dims, shape, strict=True):
            m = np.ones(size, bool)
            if dim == PATCH and self.patches is not None:  # all its strata
                m = ctx.cells(
                    ctx.select(self.patches, f"{loc}.patches"), self.covariate
                )
            elif dim == FEATURE and self.features is not None:
                m = self._feature_mask(ctx, size, f"{loc}.features")
            axes.append(m)
        out = np.ones(shape, bool)
        for k, m in enumerate(axes):
            out &= m.reshape([-1 if j == k else 1 for j in range(len(shape))])
        return out

    def _dims(self, ctx: BindContext, loc: str) -> tuple[str, ...]:
        """The covariate's non-time dims, checked against the fields given."""
        name, spec = self.covariate, ctx.spec
        cov_specs = {c.name: c for c in spec.covariates}
        if name not in cov_specs:
            hint = ""
            if name in {p.name for p in spec.parameters} or name in {
                n.name for n in spec.neural
            }:
                hint = f" ({name!r} is a parameter: use parameter = {name!r})"
            raise ctx.fail(
                f"{loc}.covariate",
                f"unknown covariate {name!r}{hint}; the model's time-varying "
                f"covariates: {join(ctx.time_varying)}",
            )
        cs = cov_specs[name]
        if not cs.time_varying:
            raise ctx.fail(
                f"{loc}.covariate",
                f"covariate {name!r} (dims {', '.join(cs.dims)}) does not vary in "
                f"time; scenarios change time-varying covariates: "
                f"{join(ctx.time_varying)}",
            )
        dims = cs.dims[1:]
        has = f"covariate {name!r} has dims ({', '.join(cs.dims)})"
        for field, dim in (("features", FEATURE), ("inflow", PATCH_TO)):
            if getattr(self, field) is not None and dim not in dims:
                raise ctx.fail(f"{loc}.{field}", f"{has}: no {dim} axis for '{field}'")
        if self.outflow is not None and PATCH_TO not in dims:
            raise ctx.fail(f"{loc}.outflow", f"{has}: no {PATCH_TO} axis for 'outflow'")
        if self.patches is not None and PATCH_TO in dims:
            raise ctx.fail(
                f"{loc}.patches",
                f"covariate {name!r} couples patches: give inflow (rows: what "
                "reaches the patches) and/or outflow (columns: what leaves them)",
            )
        if self.patches is not None and PATCH not in dims:
            raise ctx.fail(f"{loc}.patches", f"{has}: no patch axis")
        return dims

    def _coupling_entries(self, ctx: BindContext, loc: str, shape) -> np.ndarray:
        """`(patch, patch_to)`: the rows of `inflow` and columns of `outflow`
        (all entries without either); a `value` only on existing links."""
        out = np.ones(shape, bool)
        if self.inflow is not None or self.outflow is not None:
            if kron_operands(ctx.spec).get(self.covariate) == "stratum":
                field = "inflow" if self.inflow is not None else "outflow"
                raise ctx.fail(
                    f"{loc}.{field}",
                    f"covariate {self.covariate!r} is the contact matrix over "
                    f"strata of kron(M, C): it has no patches; change it whole "
                    "(leave out inflow and outflow), or change the matrix over "
                    "patches",
                )
            n = len(ctx.patches)
            rows, cols = np.zeros(n, bool), np.zeros(n, bool)
            if self.inflow is not None:
                rows = ctx.select(self.inflow, f"{loc}.inflow")
            if self.outflow is not None:
                cols = ctx.select(self.outflow, f"{loc}.outflow")
            rows, cols = (
                ctx.cells(rows, self.covariate),
                ctx.cells(cols, self.covariate),
            )
            out = rows[:, None] | cols[None, :]
        if self.value is not None:  # replace weights of existing links only
            out &= _links(host_covariate(ctx.covariates[self.covariate], None))
        return out

    def _feature_mask(self, ctx: BindContext, size: int, loc: str) -> np.ndarray:
        """The feature axis mask (indices, or labels when the data label the
        features)."""
        name = self.covariate
        labels = [str(x) for x in ctx.feature_labels.get(name, ())]
        m = np.zeros(size, bool)
        for k, f in enumerate(self.features):
            if isinstance(f, str):
                if f not in labels:
                    have = (
                        f"features {list_labels(labels)}"
                        if labels
                        else f"no feature labels: give indices 0..{size - 1}"
                    )
                    raise ctx.fail(
                        f"{loc}[{k}]",
                        f"unknown feature {f!r}; covariate {name!r} has {have}",
                    )
                m[labels.index(f)] = True
            elif not 0 <= f < size:
                raise ctx.fail(
                    f"{loc}[{k}]",
                    f"feature index {f} is out of range; covariate {name!r} has "
                    f"{size} features (0..{size - 1})",
                )
            else:
                m[f] = True
        return m

    def apply(
        self, start: int, end: int, entries: np.ndarray, arrays: ScenarioArrays
    ) -> None:
        """A copy of the covariate (dense or sparse) with the change applied
        on days `start .. end - 1` to `entries` (a mask over the dense
        non-time axes) replaces it in `arrays`."""
        v = arrays.covariates[self.covariate]
        if isinstance(v, SparseCoupling):
            values = np.array(v.values, copy=True)
            cols = np.asarray(v.columns)
            stored = entries[np.arange(cols.shape[0])[:, None], cols]
            block = values[start:end]
            if self.scale is not None:
                block[:, stored] *= self.scale
            else:
                block[:, stored] = self.value
            arrays.covariates[self.covariate] = SparseCoupling(values, cols)
            return
        a = np.array(v, copy=True)
        block = a[start:end]
        if self.scale is not None:
            block[:, entries] *= self.scale
        else:
            block[:, entries] = self.value
        arrays.covariates[self.covariate] = a
