"""`Profile`: a profile likelihood, its interval, and `PROFILE.nc`.

The interval is found here from the profile values (see
`epifit.fitting._profile` for the grid and the program that computes them);
the file holds the grid, the values, the re-optimised parameters, the
interval with the Laplace one beside it, and the fit's provenance
(`epifit_kind = "profile"`).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

from epifit._paths import file_sha256
from epifit.data import DataError, open_dataset, write_dataset

__all__ = ["KIND", "Profile", "crossings"]

KIND = "profile"
POINT = "point"


def crossings(
    grid_x: np.ndarray, delta: np.ndarray, cut: float, at: int
) -> tuple[float, float, list[str]]:
    """The lower and upper ends on the transformed scale where `delta` (the
    profile minus its minimum) first reaches `cut` walking outwards from index
    `at` (the minimum), interpolated linearly in the signed root
    `± sqrt(2 delta)`; NaN on a side where it never does. Also notes: a
    profile that falls back below the cut beyond a crossing (the region
    inside the cut is not one interval)."""
    root = np.sqrt(2.0 * np.clip(delta, 0.0, None))
    target = math.sqrt(2.0 * cut)
    ends, notes = [], []
    for step, sign in ((-1, -1.0), (1, 1.0)):
        end = math.nan
        i = at
        while 0 <= i + step < grid_x.size:
            k = i + step
            if not np.isfinite(delta[k]):
                break  # a failed point: no crossing found beyond it
            if delta[k] >= cut:
                r0, r1 = sign * root[i], sign * root[k]
                w = (sign * target - r0) / (r1 - r0)
                end = float(grid_x[i] + w * (grid_x[k] - grid_x[i]))
                beyond = delta[k + step :: step] if step > 0 else delta[:k][::-1]
                if np.any(np.isfinite(beyond) & (beyond < cut)):
                    side = "below" if step < 0 else "above"
                    notes.append(
                        f"the profile falls back under the cut {side} the "
                        "interval: the region inside the cut is not one interval"
                    )
                break
            i = k
        ends.append(end)
    return ends[0], ends[1], notes


@dataclasses.dataclass
class Profile:
    """The profile likelihood of one free parameter of a fit.

    Attributes:
        parameter: the free entry profiled (a label of the free vector).
        grid: the profiled parameter's values (constrained scale);
            `grid_x` the same on the transformed scale.
        value: the profiled function at each grid point: the fit's negative
            log-likelihood (or log-posterior), the other parameters
            re-optimised (see [`profile`][epifit.fitting.profile]).
        delta: `value - minimum`.
        x: `(point, free)` the re-optimised free vectors (transformed);
            `free_labels` their labels.
        estimates: `(point, parameter)` the constrained values of the fit
            table's free and derived rows there; `estimate_labels`.
        converged: whether the inner minimisation met its tolerance at each
            point; `steps` its iterations.
        estimate: the fitted value; `minimum` the lowest profile value.
        lower, upper: the likelihood-ratio interval at `level` (NaN on a side
            that is not identifiable); `cut`: `chi2_1(level) / 2`.
        identifiable: `(lower side, upper side)`: whether the profile reaches
            the cut on that side within the grid.
        laplace_lower, laplace_upper: the Laplace interval at `level`.
        notes: remarks (failed points, non-identifiable sides, ...).
        attrs: provenance (the fit's model and data hashes, versions, ...).
    """

    parameter: str
    grid: np.ndarray
    grid_x: np.ndarray
    value: np.ndarray
    delta: np.ndarray
    x: np.ndarray
    free_labels: list[str]
    estimates: np.ndarray
    estimate_labels: list[str]
    converged: np.ndarray
    steps: np.ndarray
    estimate: float
    minimum: float
    level: float
    cut: float
    lower: float
    upper: float
    identifiable: tuple[bool, bool]
    laplace_lower: float
    laplace_upper: float
    notes: list[str]
    attrs: dict[str, Any]

    # -- building ---------------------------------------------------------------
    @classmethod
    def build(cls, *, fit, fit_path, constrain, grid_x, value, centre, cut, **kw):
        """The profile from the program's outputs (see `profile`);
        `constrain` maps transformed values of the entry to constrained ones."""
        notes = list(kw.pop("notes"))
        finite = np.isfinite(value)
        if not finite[centre]:
            raise FloatingPointError(
                f"the profiled function is not finite at the fitted point "
                f"({kw['parameter']} = {float(constrain(grid_x[centre])):.6g})"
            )
        failed = int((~kw["converged"]).sum())
        if failed:
            notes.append(
                f"{failed} of {value.size} points did not converge (inner "
                f"minimisation), {int((~finite).sum())} with a non-finite value"
            )
        at = int(np.argmin(np.where(finite, value, np.inf)))
        minimum = float(value[at])
        if value[centre] - minimum > 1e-6 * max(1.0, abs(minimum)):
            notes.append(
                f"the profile is lower than at the fit (by "
                f"{value[centre] - minimum:.4g}"
                f" at {kw['parameter']} = {float(constrain(grid_x[at])):.6g}): the "
                "fit did not reach the optimum; fit again from there"
            )
        delta = value - minimum
        lo_x, hi_x, more = crossings(grid_x, delta, cut, at)
        notes += more
        lower, upper = (
            float(constrain(e)) if math.isfinite(e) else math.nan for e in (lo_x, hi_x)
        )
        if lower > upper:  # a decreasing transform
            lower, upper = upper, lower
        ident = (math.isfinite(lower), math.isfinite(upper))
        for side, ok, end in (("lower", ident[0], 0), ("upper", ident[1], -1)):
            if not ok:
                notes.append(
                    f"not identifiable on the {side} side: the profile rises by only "
                    f"{np.nanmax(delta[: at + 1] if end == 0 else delta[at:]):.4g} "
                    f"(the cut is {cut:.4g}) out to {kw['parameter']} = "
                    f"{float(constrain(grid_x[end])):.6g}"
                )
        lap = _laplace_interval(fit, kw["parameter"], kw["level"], constrain, kw)
        return cls(
            parameter=kw["parameter"],
            grid=np.asarray(constrain(grid_x), np.float64),
            grid_x=grid_x,
            value=value,
            delta=delta,
            x=kw["x"],
            free_labels=kw["free_labels"],
            estimates=kw["reported"],
            estimate_labels=kw["reported_labels"],
            converged=kw["converged"],
            steps=kw["steps"],
            estimate=float(constrain(grid_x[centre])),
            minimum=minimum,
            level=kw["level"],
            cut=cut,
            lower=lower,
            upper=upper,
            identifiable=ident,
            laplace_lower=lap[0],
            laplace_upper=lap[1],
            notes=notes,
            attrs=_provenance(fit, fit_path, kw),
        )

    # -- views ------------------------------------------------------------------
    @property
    def identified(self) -> bool:
        return all(self.identifiable)

    def summary(self) -> str:
        """A short text report: the interval (or which side is not
        identifiable), the Laplace interval, and the notes."""

        def end(v):
            return f"{v:.6g}" if math.isfinite(v) else "not identifiable"

        pct = f"{100 * self.level:g}%"
        lines = [
            f"profile of {self.parameter}: estimate {self.estimate:.6g}, "
            f"{self.grid.size} points from {self.grid.min():.6g} to "
            f"{self.grid.max():.6g}",
            f"{pct} likelihood-ratio interval [{end(self.lower)}, {end(self.upper)}]"
            f" (cut {self.cut:.4g} above the minimum {self.minimum:.10g})",
            f"{pct} Laplace interval          [{self.laplace_lower:.6g}, "
            f"{self.laplace_upper:.6g}]",
        ]
        return "\n".join(lines + [f"note: {n}" for n in self.notes])

    def __str__(self) -> str:
        return self.summary()

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready summary (non-finite numbers as they are; the CLI's
        `dumps` writes them as null)."""
        return {
            "parameter": self.parameter,
            "estimate": self.estimate,
            "level": self.level,
            "lower": self.lower,
            "upper": self.upper,
            "identifiable": {
                "lower": self.identifiable[0],
                "upper": self.identifiable[1],
            },
            "laplace": {"lower": self.laplace_lower, "upper": self.laplace_upper},
            "minimum": self.minimum,
            "cut": self.cut,
            "points": int(self.grid.size),
            "grid": self.grid.tolist(),
            "delta": self.delta.tolist(),
            "converged": int(self.converged.sum()),
            "notes": list(self.notes),
        }

    # -- netCDF -----------------------------------------------------------------
    def to_dataset(self) -> xr.Dataset:
        """`PROFILE.nc` as a Dataset (`epifit_kind = "profile"`)."""
        ds = xr.Dataset(
            coords={
                POINT: (POINT, np.arange(self.grid.size)),
                "free": ("free", list(self.free_labels)),
                "parameter": ("parameter", list(self.estimate_labels)),
            }
        )
        ds["grid"] = (POINT, self.grid, {"long_name": f"{self.parameter} (fixed)"})
        ds["grid_unconstrained"] = (POINT, self.grid_x)
        ds["profile"] = (
            POINT,
            self.value,
            {
                "long_name": "negative log-likelihood (or log-posterior), the other "
                "parameters re-optimised"
            },
        )
        ds["delta"] = (POINT, self.delta, {"long_name": "profile minus its minimum"})
        ds["converged"] = (POINT, self.converged.astype(np.int8))
        ds["steps"] = (POINT, self.steps.astype(np.int32))
        ds["x"] = ((POINT, "free"), self.x, {"long_name": "re-optimised free vector"})
        ds["estimates"] = (
            (POINT, "parameter"),
            self.estimates,
            {"long_name": "re-optimised constrained values"},
        )
        ds.attrs = {
            **self.attrs,
            "title": f"epifit profile likelihood of '{self.parameter}'",
            "epifit_kind": KIND,
            "parameter": self.parameter,
            "estimate": self.estimate,
            "minimum": self.minimum,
            "level": self.level,
            "cut": self.cut,
            "lower": self.lower,
            "upper": self.upper,
            "lower_identifiable": int(self.identifiable[0]),
            "upper_identifiable": int(self.identifiable[1]),
            "laplace_lower": self.laplace_lower,
            "laplace_upper": self.laplace_upper,
            "notes": json.dumps(self.notes),
        }
        return ds

    def to_netcdf(self, path: str | os.PathLike) -> Path:
        """Write `PROFILE.nc` atomically."""
        return write_dataset(self.to_dataset(), path)

    @classmethod
    def from_netcdf(cls, path: str | os.PathLike) -> Profile:
        """Read a `PROFILE.nc` back."""
        ds = open_dataset(path)
        a = ds.attrs
        if a.get("epifit_kind") != KIND:
            raise DataError(
                f"'{path}' is not an epifit profile file (epifit_kind = "
                f"{a.get('epifit_kind')!r}); write one with `epifit profile`."
            )
        need = ("grid", "grid_unconstrained", "profile", "delta", "x", "estimates")
        missing = [v for v in need if v not in ds]
        if missing:
            raise DataError(
                f"'{path}' is not a complete profile file: no variable "
                f"{', '.join(map(repr, missing))}; write it again with "
                "`epifit profile`."
            )
        keys = {f.name for f in dataclasses.fields(cls)}
        scalars = ("estimate", "minimum", "level", "cut", "lower", "upper")
        return cls(
            parameter=str(a["parameter"]),
            grid=ds["grid"].values,
            grid_x=ds["grid_unconstrained"].values,
            value=ds["profile"].values,
            delta=ds["delta"].values,
            x=ds["x"].values,
            free_labels=[str(v) for v in ds["free"].values],
            estimates=ds["estimates"].values,
            estimate_labels=[str(v) for v in ds["parameter"].values],
            converged=ds["converged"].values.astype(bool),
            steps=ds["steps"].values,
            **{k: float(a[k]) for k in scalars},
            identifiable=(bool(a["lower_identifiable"]), bool(a["upper_identifiable"])),
            laplace_lower=float(a["laplace_lower"]),
            laplace_upper=float(a["laplace_upper"]),
            notes=json.loads(a.get("notes", "[]")),
            attrs={k: v for k, v in a.items() if k not in keys},
        )


def _laplace_interval(fit, label, level, constrain, kw) -> tuple[float, float]:
    """The Laplace interval of `label` at `level`: the fit table's when its
    level is the same, else `c(x ± z se)` from the standard error used."""
    row = next((r for r in fit.table if r["label"] == label), None)
    if row is not None and math.isclose(fit.uncertainty.get("level", 0.95), level):
        return float(row["lower"]), float(row["upper"])
    from statistics import NormalDist

    se = kw["se_x"]
    if not math.isfinite(se):
        return math.nan, math.nan
    z = NormalDist().inv_cdf(0.5 + level / 2)
    x = float(fit.x[kw["index"]])
    ends = sorted(float(constrain(x + s * z * se)) for s in (-1.0, 1.0))
    return ends[0], ends[1]


def _provenance(fit, fit_path, kw) -> dict[str, Any]:
    """The fit's provenance, and what the profile was run with."""
    attrs: dict[str, Any] = {
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "points": int(kw["grid_points"]),
        "span": kw["span"],
        "laplace_se_unconstrained": kw["se_x"],
        "likelihood_scale": kw["scale"],
        "fit_loss": float(fit.loss),
        "model_text": fit.model_text,
        **{k: v for k, v in fit.hashes.items() if v},
        **{f"version_{k}": v for k, v in fit.versions.items()},
    }
    if fit.problem is not None:
        attrs["model"] = fit.problem.spec.name
    if fit_path is not None:
        attrs["fit_file"] = str(fit_path)
        attrs["fit_file_absolute"] = str(Path(fit_path).resolve())
        attrs["fit_sha256"] = file_sha256(fit_path)
    return attrs
