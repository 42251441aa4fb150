"""Strata beside patches: a second structure axis laid onto the patch axis.

A model with `[strata] age = ["0-19", "20-64", "65+"]` is compiled on the
*cell* axis, patch-major: cell `p * n_strata + s` is stratum `s` of patch
`p`. Everything below the model's boundary (the plan, the vector field, the
couplings, the solver and its adjoints) sees one structure axis, the cells,
as it sees patches in a model without strata. This module holds the
translations at that boundary: the dims of a covariate on the cell axis, a
data array flattened onto the cells (contact matrices as `kron(I_patch, C)`,
patch couplings as `kron(M, I_strata)`), parameter values expanded to the
cells, and predictions summed over strata. A coupling that names both a
matrix over patches and a contact matrix (`contacts`) is `kron(M, C)`: its
two operands stay on their own axes (`kron_operands`) and are applied as two
small contractions (`KronCoupling`). See docs/models.md, *Strata*.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from epifit._schema import PATCH, PATCH_TO, TIME
from epifit._toml import at, join
from epifit.model._spec import StrataSpec

__all__ = [
    "STRATA_OBSERVED",
    "cell_array",
    "cell_dims",
    "cell_value",
    "check_kron_operands",
    "check_kron_sizes",
    "check_stratum_values",
    "kron_operands",
    "read_contacts",
    "read_per_stratum",
    "read_strata",
    "strata_dims_hint",
    "stratum_shape",
    "sum_strata",
]

STRATA_OBSERVED = ("sum", "each")
"""`strata` of an observation: compared summed over strata, or per stratum."""


def read_strata(ctx) -> StrataSpec | None:
    """`[strata]`: exactly one `NAME = [labels]` (unique strings), or `None`."""
    if "strata" not in ctx.raw:
        return None
    r = ctx.r
    t = ctx.raw["strata"]
    if not isinstance(t, Mapping) or len(t) != 1:
        raise r.fail(
            "strata",
            f'expected one stratum axis (e.g. age = ["0-19", "65+"]), got {t!r}',
        )
    ((name, raw),) = t.items()
    loc = at("strata", name)
    if not (isinstance(name, str) and name.isidentifier()) or name in (
        PATCH,
        PATCH_TO,
        "time",
        "feature",
        "stage",
    ):
        raise r.fail(
            loc,
            f"{name!r} is not a usable axis name (an identifier "
            "other than time, patch, patch_to, feature, stage)",
        )
    labels = tuple(r.string(v, at(loc, j)) for j, v in enumerate(r.array(raw, loc)))
    if len(set(labels)) != len(labels):
        raise r.fail(loc, f"labels repeat: {list(labels)}")
    return StrataSpec(name, labels)


def read_per_stratum(ctx, t, loc: str) -> bool:
    """The `per_stratum` field: needs `[strata]`."""
    if "per_stratum" not in t:
        return False
    value = ctx.r.boolean(t["per_stratum"], at(loc, "per_stratum"))
    if value and ctx.strata is None:
        raise ctx.r.fail(
            at(loc, "per_stratum"),
            "per_stratum = true needs a [strata] table (e.g. [strata] "
            'age = ["0-19", "20-64", "65+"])',
        )
    return value


def strata_dims_hint(ctx) -> str:
    """What a model with `[strata]` may also give as dims."""
    if ctx.strata is None:
        return ""
    a = ctx.strata.name
    return (
        f"; with [strata] {a} also [{a!r}], ['patch', {a!r}], ['time', {a!r}], "
        f"['time', 'patch', {a!r}] and the contact matrix [{a!r}, {ctx.strata.to!r}]"
    )


def check_stratum_values(ctx, loc: str, n_values: int, per_time) -> None:
    """A per_stratum parameter: one value or one per stratum, constant in time."""
    if n_values not in (1, ctx.strata.size):
        raise ctx.r.fail(
            at(loc, "value"),
            f"has {n_values} values but [strata] {ctx.strata.name} has "
            f"{ctx.strata.size} strata",
        )
    if per_time is not None:
        raise ctx.r.fail(
            at(loc, "per_time"), "per_stratum parameters cannot vary in time yet"
        )


def read_contacts(ctx, t, loc: str, covariate: str) -> str | None:
    """A coupling's `contacts` field: a contact matrix over strata (data dims
    `[age, age_to]` or `[time, age, age_to]`) beside `covariate`, which must
    then be a matrix over patches; the coupling is `kron(M, C)`."""
    if "contacts" not in t:
        return None
    cl = at(loc, "contacts")
    if ctx.strata is None:
        raise ctx.r.fail(
            cl,
            "a contact matrix over strata needs a [strata] table (e.g. [strata] "
            'age = ["0-19", "20-64", "65+"])',
        )
    name = ctx.r.string(t["contacts"], cl)
    a, a_to = ctx.strata.name, ctx.strata.to
    want = ((a, a_to), (TIME, a, a_to))
    if ctx.covariate_data_dims.get(name) not in want:
        usable = [c for c, d in ctx.covariate_data_dims.items() if d in want]
        raise ctx.r.fail(
            cl,
            f"{name!r} is not a covariate with dims [{a!r}, {a_to!r}] or "
            f"['time', {a!r}, {a_to!r}]; such covariates: {join(usable)}",
        )
    have = ctx.covariate_data_dims[covariate]
    if have not in ((PATCH, PATCH_TO), (TIME, PATCH, PATCH_TO)):
        raise ctx.r.fail(
            at(loc, "covariate"),
            f"with contacts, the covariate is the matrix over patches (dims "
            f"['patch', 'patch_to'] or ['time', 'patch', 'patch_to']) of "
            f"kron(M, C); {covariate!r} has dims {list(have)}",
        )
    ctx.used.add(name)
    return name


def kron_operands(spec) -> dict[str, str]:
    """The covariates of `kron(M, C)` couplings, kept on their own axes (not
    the cells): name -> `"patch"` (M) or `"stratum"` (C)."""
    out = {}
    for c in spec.couplings:
        if c.contacts is not None:
            out[c.covariate], out[c.contacts] = PATCH, "stratum"
    return out


def check_kron_operands(ctx, couplings) -> None:
    """A covariate of a `kron(M, C)` coupling (kept on its own axis) is no
    other coupling's matrix on the cells."""
    kron = {}
    for c in couplings:
        if c.contacts is not None:
            kron.update({c.covariate: c.name, c.contacts: c.name})
    for c in couplings:
        if c.contacts is None and c.covariate in kron:
            raise ctx.r.fail(
                at(at("couplings", c.name), "covariate"),
                f"covariate {c.covariate!r} is an operand of kron(M, C) in coupling "
                f"{kron[c.covariate]!r} (kept on its own axis), so it cannot also "
                "be a matrix on the cells here; declare a second covariate for "
                "this coupling",
            )


def check_kron_sizes(role: str, shape, n_strata: int, fail) -> int | None:
    """The operand of `kron(M, C)` of `role` (`kron_operands`) checked: `C`
    is `(.., stratum, stratum)`; `M` square. Returns the patches of `M`."""
    n, m = shape[-2:]
    if role != PATCH:
        if (n, m) != (n_strata, n_strata):
            raise fail(
                f"shape {tuple(shape)}: a contact matrix over {n_strata} strata "
                f"is ({n_strata}, {n_strata}) on each day"
            )
        return None
    if n != m:
        raise fail(f"shape {tuple(shape)}: the matrix over patches is not square")
    return int(n)


def cell_dims(dims: tuple[str, ...], strata: StrataSpec) -> tuple[str, ...]:
    """The dims of a covariate on the cell axis: the stratum axis is dropped
    beside `patch` and becomes `patch` alone; `NAME_to` becomes `patch_to`."""
    a, a_to = strata.name, strata.to
    out = []
    for d in dims:
        if d == a:
            if PATCH not in dims:
                out.append(PATCH)
        elif d == a_to:
            if PATCH_TO not in dims:
                out.append(PATCH_TO)
        else:
            out.append(d)
    return tuple(out)


def cell_array(
    dims: tuple[str, ...], array: Any, n_patches: int, strata: StrataSpec
) -> np.ndarray:
    """A concrete data array of `dims` (the data's) on the cell axis.

    `(.., age)` is tiled over patches, `(.., patch, age)` flattened,
    `(.., patch)` repeated over strata; a contact matrix `(.., age, age_to)`
    becomes `kron(I_patch, C)` (mixing within each patch), a patch coupling
    `(.., patch, patch_to)` becomes `kron(M, I_strata)` (each stratum meets
    the same stratum elsewhere)."""
    a, a_to, S, P = strata.name, strata.to, strata.size, n_patches
    x = np.asarray(array)
    dims = list(dims)
    if a_to in dims:
        if PATCH in dims or PATCH_TO in dims:
            raise ValueError(f"dims {dims}: a stratum matrix is not per patch")
        x = np.moveaxis(x, [dims.index(a), dims.index(a_to)], [-2, -1])
        eye = np.eye(P, dtype=x.dtype)
        return np.einsum("pq,...st->...psqt", eye, x).reshape(
            *x.shape[:-2], P * S, P * S
        )
    if PATCH_TO in dims:
        x = np.moveaxis(x, [dims.index(PATCH), dims.index(PATCH_TO)], [-2, -1])
        eye = np.eye(S, dtype=x.dtype)
        return np.einsum("...pq,st->...psqt", x, eye).reshape(
            *x.shape[:-2], P * S, P * S
        )
    if a in dims and PATCH in dims:
        i = dims.index(PATCH)
        x = np.moveaxis(x, dims.index(a), i + 1 if dims.index(a) > i else i)
        return x.reshape(*x.shape[:i], P * S, *x.shape[i + 2 :])
    if a in dims:
        i = dims.index(a)
        x = np.moveaxis(x, i, -1)
        x = np.tile(x, (1,) * (x.ndim - 1) + (P,))
        return np.moveaxis(x, -1, i)
    if PATCH in dims:
        return np.repeat(x, S, axis=dims.index(PATCH))
    return x


def cell_value(
    value: Any, per_patch: bool, per_stratum: bool, n_patches: int | None, S: int
) -> Any:
    """A parameter's value on the cells: `(.., patch, stratum)` flattened,
    `(.., stratum)` tiled over patches, `(.., patch)` repeated over strata."""
    if per_stratum and per_patch:
        return jnp.reshape(value, (*jnp.shape(value)[:-2], -1))
    if per_stratum:
        if n_patches is None:
            raise ValueError(
                "a per_stratum parameter needs the number of patches: bind the "
                "model first (model.bind_patches(n_patches), which "
                "epifit.simulation.Problem does)"
            )
        return jnp.tile(value, (1,) * (jnp.ndim(value) - 1) + (n_patches,))
    if per_patch:
        return jnp.repeat(value, S, axis=-1)
    return value


def stratum_shape(p, n_patches: int, model) -> tuple[int, ...]:
    """The shape of per_stratum parameter `p`: `(stratum,)` or `(patch, stratum)`."""
    S = model.n_strata
    return (n_patches, S) if p.per_patch else (S,)


def sum_strata(series: Any, S: int) -> Any:
    """`(day, cell)` summed over strata: `(day, patch)`."""
    n, c = jnp.shape(series)
    return jnp.sum(jnp.reshape(series, (n, c // S, S)), axis=-1)
