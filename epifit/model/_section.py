"""What the section readers of a model description share: the located reader,
the raw top-level tables and the namespace declared so far.

Every section reader (`_validate`, `_transition`, `_observation`) is a function
of one `SectionContext`, called in dependency order by
[`spec_from_dict`][epifit.model.spec_from_dict]: a section declares its names
here and reads the names of the sections before it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from epifit._errors import describe_type
from epifit._toml import at, join
from epifit.model._expression import Expression, fold, parse_expression
from epifit.model._fields import PLURALS, REQUIRED_RANGES, TOP_LEVEL, ModelReader

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
        covariate_dims: covariate -> dims (from `[covariates]`; on the cells
            with `[strata]`), covariate_data_dims: the dims the data give.
        coupling_names: the declared couplings (from `[couplings]`).
        constants: name -> value of the fixed parameters and of the derived
            quantities of them: what is known before any fit.
        start: name -> value of every parameter and derived quantity at the
            parameters' initial values.
        ranges: parameter -> `(transform, lower, upper, fixed)`.
        range_checks: `(location, context, expression)` of every expression
            whose field has a required range (`REQUIRED_RANGES`), for
            checking it again at other parameter values (`range_violations`).
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
        self.covariate_data_dims: dict[str, tuple[str, ...]] = {}
        self.strata = None  # the StrataSpec of `[strata]`, if any
        self.coupling_names: list[str] = []
        self.constants: dict[str, np.ndarray] = {}
        self.start: dict[str, np.ndarray] = {}
        self.ranges: dict[str, tuple[str, float, float, bool]] = {}
        self.range_checks: list[tuple[str, str, Expression]] = []

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
        self,
        value: Any,
        location: str,
        allowed: tuple[str, ...],
        context: str,
        *,
        check: bool = True,
    ) -> Expression:
        """An expression whose names are declared symbols of the `allowed` kinds;
        marks them used. `context` names the use in messages (`"a rate"`) and
        selects the values it requires (`REQUIRED_RANGES`); with `check`, its
        value is checked as [`check_value`][] says."""
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
        if check:
            self.check_value(expr, location, context)
        return expr

    def check_value(self, expr: Expression, location: str, context: str) -> None:
        """Refuse what cannot be a valid value of `context`, known at load time:

        - a constant part that is not finite or divides by zero (`gamma / 0`,
          `exp(1000)`, `log(N - N)` with `N` fixed);
        - a value outside the field's range (`REQUIRED_RANGES`: rates,
          transmission rates and initial conditions >= 0, probabilities in
          [0, 1], populations > 0), for a constant expression or at the
          parameters' initial values (which lie in their ranges, so an
          expression invalid for every value, `-beta`, is caught there);
        - a probability that is a free parameter whose transform can leave
          [0, 1] (the identity: a fit would move it to any real number).

        What depends on covariates or on fitted values is checked at run time.
        """
        _, problem = fold(expr, self.constants)
        if problem is not None:
            raise self.r.fail(
                location,
                f"expression {expr.source!r} is not finite: {problem}; "
                f"{context} must be a finite number",
            )
        if context not in REQUIRED_RANGES:
            return
        self.range_checks.append((location, context, expr))
        lo, hi, closed = REQUIRED_RANGES[context]
        want = range_text(context)
        # the start is checked for its range only: a non-finite start is the
        # fit's to report (a fit may start elsewhere, `values=`)
        value, _ = fold(expr, self.start)
        if value is not None:
            v = np.ravel(value)
            bad = (v < lo) | (v > hi) | ((v == lo) & (not closed))
            if bad.any():
                when = (
                    ""
                    if fold(expr, self.constants)[0] is not None
                    else (" at the parameters' initial values")
                )
                got = float(v[bad][0])
                tree = expr.tree
                literal = tree[0] == "num" or (tree[0] == "neg" and tree[1][0] == "num")
                is_ = "got" if literal else f"{expr.source!r} is"
                raise self.r.fail(
                    location, f"{context} must be {want}, but {is_} {got!r}{when}"
                )
        if expr.tree[0] == "name" and expr.tree[1] in self.ranges:
            name = expr.tree[1]
            transform, plo, phi, fixed = self.ranges[name]
            if not fixed and (plo < lo or phi > hi):
                if hi < math.inf or phi < lo:
                    raise self.r.fail(
                        location,
                        f"{context} must be {want}, but parameter {name!r} "
                        f"(transform {transform!r}) ranges over [{plo:g}, {phi:g}] "
                        "in a fit; give it "
                        + (
                            'transform = "sigmoid" (range (0, 1))'
                            if hi < math.inf
                            else 'transform = "softplus" (range (0, inf))'
                        ),
                    )


def range_text(context: str) -> str:
    """What a value of `context` must be, in words: `>= 0`, `in [0, 1]`."""
    lo, hi, closed = REQUIRED_RANGES[context]
    if hi < math.inf:
        return f"in [{lo:g}, {hi:g}]"
    return f">= {lo:g}" if closed else f"> {lo:g}"


def range_violations(
    checks: tuple[tuple[str, str, Expression], ...],
    values: Mapping[str, Any],
    daily: Mapping[str, Any] | None = None,
) -> list[str]:
    """The range checks (`SectionContext.range_checks`) that fail at the
    constrained parameter and derived `values` (concrete numbers), as
    sentences naming the field and the expression; an expression that reads
    a time-varying parameter is checked at its `daily` values (`(day[,
    patch])`), naming the first day that fails, and skipped without them;
    expressions that read covariates or neural sub-models are not constant
    here and are skipped. Cost: one NumPy evaluation of each checked
    expression (over the days for those that read `daily`)."""
    env = {k: np.asarray(v, np.float64) for k, v in values.items() if _numeric(v)}
    days = {}
    for k, v in (daily or {}).items():
        v = np.asarray(v, np.float64)
        days[k] = v[:, None] if v.ndim == 1 else v  # (day, patch or 1)
        env.pop(k, None)  # its coefficients are not its value
    out = []
    for location, context, expr in checks:
        timed = bool(expr.names & days.keys())
        value, _ = fold(expr, {**env, **days} if timed else env)
        if value is None:
            continue
        lo, hi, closed = REQUIRED_RANGES[context]
        bad = (value < lo) | (value > hi) | ((value == lo) & (not closed))
        if np.any(bad):
            first = int(np.flatnonzero(bad)[0])
            when = f" on day {np.unravel_index(first, bad.shape)[0]}" if timed else ""
            out.append(
                f"{location}: {context} must be {range_text(context)}, but "
                f"{expr.source!r} is {float(np.ravel(value)[first])!r}{when}"
            )
    return out


def _numeric(value: Any) -> bool:
    try:
        return np.asarray(value).dtype.kind in "fiub"
    except Exception:  # a neural sub-model
        return False
