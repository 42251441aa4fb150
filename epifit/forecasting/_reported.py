"""The series a forecast reports, checked: the observed series (always), the
compartments asked for, `R_eff` (with infections) and the derived series
(`[derived]` reading compartment totals or covariates, `ModelSpec.series`).

A derived series is reported like `R_eff`: quantiles and the point estimate
per patch, no peak or cumulative statistics and no sum over patches (a ratio
or a level of each patch is not additive)."""

from __future__ import annotations

from epifit.data import PATCH, QUANTILE, SCENARIO, TIME
from epifit.forecasting._output import STATISTICS
from epifit.model import has_reproduction_number

__all__ = ["check_reported"]

# the forecast's coordinates and its variable that belongs to no series
_RESERVED = (SCENARIO, "scenario_description", QUANTILE, TIME, "day", PATCH)


def check_reported(
    model, compartments: tuple[str, ...], observations: tuple[str, ...]
) -> tuple[str, ...]:
    """The compartments to report (the model's, none of them observed),
    checked with the derived series: none may be written under a name that
    another series of the forecast (or its coordinates) also uses, e.g. a
    derived `cases` beside the observed series `cases`.

    Raises:
        ValueError: an unknown or observed compartment; a derived series
            whose variable another series writes (naming both).
    """
    unknown = [c for c in compartments if c not in model.compartments]
    if unknown:
        raise ValueError(
            f"Unknown compartment(s) {unknown}; model '{model.spec.name}' has "
            f"{', '.join(model.compartments)}."
        )
    clash = sorted(set(compartments) & set(observations))
    if clash:
        raise ValueError(
            f"{clash} name both a compartment and an observed series; leave them "
            "out of compartments (the observed series is always reported)."
        )
    owner = dict.fromkeys((*_RESERVED, "failed_samples"), "the forecast itself")
    kinds = [
        *((o, "observed series") for o in observations),
        *((c, "compartment") for c in compartments),
        *((("R_eff", "level"),) if has_reproduction_number(model) else ()),
    ]
    for s, kind in kinds:
        what = "the reproduction number" if kind == "level" else f"the {kind} {s!r}"
        owner.update(dict.fromkeys(_written(s, kind), what))
    for d in (d.name for d in model.spec.series):
        for var in _written(d, "derived"):
            if var in owner:
                raise ValueError(
                    f"The derived series {d!r} of model '{model.spec.name}' would "
                    f"be written to the forecast as {var!r}, which {owner[var]} "
                    "also writes; rename it in the model's [derived]."
                )
            owner[var] = f"the derived series {d!r}"
    return compartments


def _written(s: str, kind: str) -> list[str]:
    """The variables a forecast writes for series `s` of `kind`."""
    if kind == "derived":
        return [s, f"estimate_{s}"]
    out = [s, f"{s}_total", f"estimate_{s}"]
    if kind == "level":
        return [*out, f"estimate_{s}_total"]
    out += [f"{st}_{s}{t}" for st in STATISTICS for t in ("", "_total")]
    return [*out, f"observed_{s}"] if kind == "observed series" else out
