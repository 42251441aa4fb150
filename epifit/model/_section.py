"""What the section readers of a model description share: the located reader,
the raw top-level tables and the namespace declared so far.

Every section reader (`_validate`, `_transition`, `_observation`) is a function
of one `SectionContext`, called in dependency order by
[`spec_from_dict`][epifit.model.spec_from_dict]: a section declares its names
here and reads the names of the sections before it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from epifit._errors import describe_type
from epifit._toml import at, join
from epifit.model._expression import Expression, parse_expression
from epifit.model._fields import PLURALS, TOP_LEVEL, ModelReader

__all__ = ["SectionContext"]


class SectionContext:
    """The reader, the raw tables and the namespace of one model description.

    Attributes:
        r: the located reader; its errors name `file` and the field path.
        raw: the top-level table, its keys checked against the known sections.
        names: the global namespace, name -> kind (`"compartment"`, ...).
        symbols: the expression namespace, name -> `(kind, per_patch,
            time_varying)`.
        used: the names some expression or reference has read.
        stages: compartment -> number of stages (from `[[compartments]]`).
        covariate_dims: covariate -> dims (from `[covariates]`).
        coupling_names: the declared couplings (from `[couplings]`).
    """

    def __init__(self, data: Any, file: str | None):
        self.r = ModelReader(file)
        self.file = file
        self.raw = self.r.table(
            data, None, required=("compartments",), optional=TOP_LEVEL
        )
        self.names: dict[str, str] = {}
        self.used: set[str] = set()
        self.symbols: dict[str, tuple[str, bool, bool]] = {}
        self.stages: dict[str, int] = {}
        self.covariate_dims: dict[str, tuple[str, ...]] = {}
        self.coupling_names: list[str] = []

    def declare(self, name: str, kind: str, location: str) -> None:
        """Add `name` to the one namespace all declared names share."""
        if name in self.names:
            raise self.r.fail(
                location,
                f"name {name!r} is already used by a {self.names[name]}; names of "
                "compartments, parameters, derived quantities, covariates, neural "
                "sub-models and couplings share one namespace",
            )
        self.names[name] = kind

    def named_tables(self, key: str) -> list[tuple[str, Any, str]]:
        """The entries of `[key.NAME]` tables as `(name, entry, location)`."""
        value = self.raw.get(key, {})
        if not isinstance(value, Mapping):
            raise self.r.fail(
                key,
                f"expected a table of named entries ([{key}.NAME]), got "
                f"{describe_type(value)}",
            )
        return [(str(k), v, at(key, str(k))) for k, v in value.items()]

    def listed_tables(self, key: str) -> list[tuple[int, Any, str]]:
        """The entries of an `[[key]]` array as `(index, entry, location)`."""
        value = self.raw.get(key, [])
        if not isinstance(value, list | tuple):
            raise self.r.fail(
                key,
                f"expected an array of tables ([[{key}]]), got {describe_type(value)}",
            )
        return [(i, v, at(key, i)) for i, v in enumerate(value)]

    def compartment(self, value: Any, location: str) -> str:
        """A reference to a declared compartment."""
        name = self.r.string(value, location)
        if name not in self.stages:
            raise self.r.fail(
                location,
                f"unknown compartment {name!r}; known: {join(self.stages)}",
            )
        return name

    def expression(
        self, value: Any, location: str, allowed: tuple[str, ...], context: str
    ) -> Expression:
        """An expression whose names are declared symbols of the `allowed` kinds;
        marks them used. `context` names the use in messages (`"a rate"`)."""
        expr = parse_expression(value, file=self.file, location=location)
        for name in sorted(expr.names):
            if name not in self.symbols:
                known = [n for n, s in self.symbols.items() if s[0] in allowed]
                raise self.r.fail(
                    location,
                    f"unknown name {name!r} in expression {expr.source!r}; known: "
                    f"{join(known)}",
                )
            kind = self.symbols[name][0]
            if kind not in allowed:
                plural = [PLURALS[a] for a in allowed]
                raise self.r.fail(
                    location,
                    f"{name!r} (a {kind}) cannot be used in {context}, which may use "
                    f"{', '.join(plural[:-1])} and {plural[-1]} only",
                )
            self.used.add(name)
        return expr
