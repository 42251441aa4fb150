"""`[[observations]]`: their validation, and the series each predicts from a
trajectory (the likelihoods live in the data layer)."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float

from epifit._schema import PATCH
from epifit._toml import at, join
from epifit.model._fields import FAMILIES, KINDS, STATIC_NAMES
from epifit.model._section import SectionContext
from epifit.model._spec import ObservationSpec

__all__ = ["predict", "read_observations"]


def predict(
    spec: ObservationSpec, ys: dict[str, Float[Array, "time stage patch"]]
) -> Float[Array, "time patch"]:
    """The series an observation compares with its data variable.

    `prevalence`: the sum of the listed compartments over all stages, `(time, patch)`.
    `incidence`: `sign` times its daily change, `(time - 1, patch)`; with
    `sign = -1` for a decreasing compartment (new infections as `diff(1 - S)`).
    """
    total = None
    for name in spec.compartments:
        x = ys[name].sum(axis=-2)
        total = x if total is None else total + x
    if spec.kind == "incidence":
        total = jnp.diff(total, axis=0)
        if spec.sign == -1:
            total = -total
    return total


def read_observations(ctx: SectionContext) -> tuple[ObservationSpec, ...]:
    """`[[observations]]`: data variables, kinds, families and their parameters."""
    r = ctx.r
    out = []
    fields = ("family", "weight", "sign", "dispersion", "ascertainment", "scale")
    names = set()
    for _, entry, loc in ctx.listed_tables("observations"):
        t = r.table(
            entry, loc, required=("name", "kind", "compartments"), optional=fields
        )
        name = r.string(t["name"], at(loc, "name"))
        if name in names:
            raise r.fail(at(loc, "name"), f"data variable {name!r} observed twice")
        names.add(name)
        kind = r.choice(t["kind"], at(loc, "kind"), KINDS)
        cl = at(loc, "compartments")
        raw = t["compartments"]
        if isinstance(raw, str):
            comps = (ctx.compartment(raw, cl),)
        else:
            comps = tuple(
                ctx.compartment(c, at(cl, j)) for j, c in enumerate(r.array(raw, cl))
            )
        if len(set(comps)) != len(comps):
            raise r.fail(cl, f"repeated compartment in {list(comps)}")
        family = r.choice(t.get("family", "gaussian"), at(loc, "family"), FAMILIES)
        weight = r.number(t.get("weight", 1.0), at(loc, "weight"))
        if weight <= 0:
            raise r.fail(at(loc, "weight"), f"must be > 0, got {weight}")
        sign = 1
        if "sign" in t:
            if kind != "incidence":
                raise r.fail(at(loc, "sign"), 'applies only to kind = "incidence"')
            sign = r.integer(t["sign"], at(loc, "sign"), -1)
            if sign not in (-1, 1):
                raise r.fail(at(loc, "sign"), f"must be 1 or -1, got {sign}")
        dispersion = None
        if "dispersion" in t:
            dl = at(loc, "dispersion")
            dispersion = r.string(t["dispersion"], dl)
            if family == "poisson":
                raise r.fail(dl, "a Poisson likelihood has no dispersion")
            if ctx.symbols.get(dispersion, ("",))[0] not in STATIC_NAMES:
                known = [n for n, s in ctx.symbols.items() if s[0] in STATIC_NAMES]
                raise r.fail(
                    dl,
                    f"unknown parameter {dispersion!r}; known: {join(known)}",
                )
            ctx.used.add(dispersion)
        elif family == "negative_binomial":
            raise r.fail(
                at(loc, "dispersion"),
                "missing; a negative binomial likelihood needs a dispersion parameter",
            )
        ascertainment = None
        if "ascertainment" in t:
            ascertainment = ctx.expression(
                t["ascertainment"],
                at(loc, "ascertainment"),
                STATIC_NAMES,
                "an ascertainment",
            )
        scale = None
        if "scale" in t:
            sl = at(loc, "scale")
            scale = ctx.expression(
                t["scale"], sl, (*STATIC_NAMES, "covariate"), "a scale"
            )
            for n in sorted(scale.names):
                sym = ctx.symbols[n]
                if sym[0] == "covariate" and sym[2]:
                    raise r.fail(
                        sl,
                        f"covariate {n!r} varies in time; a scale may use parameters "
                        f"and ({PATCH}) covariates such as a population only",
                    )
        out.append(
            ObservationSpec(
                name,
                kind,
                comps,
                family,
                weight,
                sign,
                dispersion,
                ascertainment,
                scale,
            )
        )
    return tuple(out)
