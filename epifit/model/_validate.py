"""Validation of a raw model description (nested dicts, as TOML gives) into a
[`ModelSpec`][epifit.model.ModelSpec]. Both front doors go through here."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from epifit._errors import describe_type
from epifit._toml import at, join
from epifit.model._expression import Expression, parse_expression
from epifit.model._fields import (
    ALL_DIMS,
    COUPLING_DIMS,
    EXPRESSION_DIMS,
    MAX_STAGES,
    NEURAL_DIMS,
    PLURALS,
    RATE_NAMES,
    RULES,
    TOP_LEVEL,
    ModelReader,
)
from epifit.model._neural import ACTIVATIONS, canonical_activation
from epifit.model._observation import read_observations
from epifit.model._spec import (
    CompartmentSpec,
    CouplingSpec,
    CovariateSpec,
    DerivedSpec,
    InitialSpec,
    ModelSpec,
    NeuralSpec,
    ParameterSpec,
)
from epifit.model._transform import (
    TRANSFORMS,
    bounds_error,
    default_bounds,
    value_error,
)
from epifit.model._transition import read_infections, read_transitions

__all__ = ["spec_from_dict"]


class Validator:
    """Reads the sections in dependency order, keeping the namespace."""

    def __init__(self, data: Any, file: str | None, default_name: str | None):
        self.r = ModelReader(file)
        self.file = file
        self.raw = self.r.table(
            data, None, required=("compartments",), optional=TOP_LEVEL
        )
        self.default_name = default_name
        self.names: dict[str, str] = {}  # global namespace: name -> kind
        self.used: set[str] = set()
        # expression namespace: name -> (kind, per_patch, time_varying)
        self.symbols: dict[str, tuple[str, bool, bool]] = {}

    # -- helpers ----------------------------------------------------------------
    def declare(self, name: str, kind: str, location: str) -> None:
        if name in self.names:
            raise self.r.fail(
                location,
                f"name {name!r} is already used by a {self.names[name]}; names of "
                "compartments, parameters, derived quantities, covariates, neural "
                "sub-models and couplings share one namespace",
            )
        self.names[name] = kind

    def named_tables(self, key: str) -> list[tuple[str, Any, str]]:
        value = self.raw.get(key, {})
        if not isinstance(value, Mapping):
            raise self.r.fail(
                key,
                f"expected a table of named entries ([{key}.NAME]), got "
                f"{describe_type(value)}",
            )
        return [(str(k), v, at(key, str(k))) for k, v in value.items()]

    def listed_tables(self, key: str) -> list[tuple[int, Any, str]]:
        value = self.raw.get(key, [])
        if not isinstance(value, list | tuple):
            raise self.r.fail(
                key,
                f"expected an array of tables ([[{key}]]), got {describe_type(value)}",
            )
        return [(i, v, at(key, i)) for i, v in enumerate(value)]

    def compartment(self, value: Any, location: str) -> str:
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

    # -- sections ---------------------------------------------------------------
    def run(self) -> ModelSpec:
        r = self.r
        if "name" in self.raw:
            name = r.string(self.raw["name"], "name")
        elif self.default_name:
            name = self.default_name
        else:
            raise r.fail("name", "missing required field 'name'")
        description = ""
        if "description" in self.raw:
            description = r.string(self.raw["description"], "description")
        compartments = self.compartments()
        covariates = self.covariates()
        parameters = self.parameters()
        neural = self.neural_models()
        derived = self.derived()
        couplings = self.couplings()
        transitions = read_transitions(self)
        infections = read_infections(self)
        observations = read_observations(self)
        initial = self.initial()
        for kind, specs in (("covariates", covariates), ("neural", neural)):
            for spec in specs:
                if spec.name not in self.used:
                    raise r.fail(
                        at(kind, spec.name),
                        f"{spec.name!r} is declared but never used; remove it or "
                        "refer to it",
                    )
        return ModelSpec(
            name=name,
            description=description,
            compartments=compartments,
            parameters=parameters,
            derived=derived,
            transitions=transitions,
            infections=infections,
            couplings=couplings,
            neural=neural,
            covariates=covariates,
            observations=observations,
            initial=initial,
            path=self.file,
        )

    def compartments(self) -> tuple[CompartmentSpec, ...]:
        r = self.r
        out = []
        self.stages: dict[str, int] = {}
        for i, entry in enumerate(r.array(self.raw["compartments"], "compartments")):
            loc = at("compartments", i)
            if isinstance(entry, str):
                entry = {"name": entry}
            t = r.table(entry, loc, required=("name",), optional=("stages",))
            name = r.identifier(t["name"], at(loc, "name"), "compartment")
            stages = r.integer(t.get("stages", 1), at(loc, "stages"), 1)
            if stages > MAX_STAGES:
                raise r.fail(at(loc, "stages"), f"more than {MAX_STAGES} stages")
            self.declare(name, "compartment", at(loc, "name"))
            self.stages[name] = stages
            out.append(CompartmentSpec(name, stages))
        return tuple(out)

    def covariates(self) -> tuple[CovariateSpec, ...]:
        r = self.r
        out = []
        rule_seen: tuple[str, str] | None = None
        for name, entry, loc in self.named_tables("covariates"):
            name = r.identifier(name, loc, "covariate")
            t = r.table(entry, loc, required=("dims",), optional=("rule",))
            dims = tuple(
                r.string(d, at(at(loc, "dims"), j))
                for j, d in enumerate(r.array(t["dims"], at(loc, "dims")))
            )
            if dims not in ALL_DIMS:
                raise r.fail(
                    at(loc, "dims"),
                    f"unsupported dims {list(dims)}; expected one of: "
                    + "; ".join(str(list(d)) for d in ALL_DIMS),
                )
            rule = None
            if "time" in dims:
                if "rule" not in t:
                    raise r.fail(
                        at(loc, "rule"),
                        "missing required field 'rule' for a covariate with a time "
                        'dim: "floor" (day k holds on [k, k+1)) or "nearest" (day k '
                        "holds on [k-1/2, k+1/2))",
                    )
                rule = r.choice(t["rule"], at(loc, "rule"), RULES)
                if rule_seen is not None and rule != rule_seen[0]:
                    raise r.fail(
                        at(loc, "rule"),
                        f"rule {rule!r} differs from rule {rule_seen[0]!r} of "
                        f"{rule_seen[1]}; all time-varying covariates share one day "
                        "grid and lookup rule",
                    )
                rule_seen = (rule, loc)
            elif "rule" in t:
                raise r.fail(
                    at(loc, "rule"),
                    "a rule applies only to covariates with a time dim",
                )
            self.declare(name, "covariate", loc)
            if dims in EXPRESSION_DIMS:
                self.symbols[name] = ("covariate", "patch" in dims, "time" in dims)
            out.append(CovariateSpec(name, dims, rule))
        self.covariate_dims = {c.name: c.dims for c in out}
        return tuple(out)

    def parameters(self) -> tuple[ParameterSpec, ...]:
        r = self.r
        out = []
        fields = ("transform", "bounds", "fixed", "per_patch")
        for name, entry, loc in self.named_tables("parameters"):
            name = r.identifier(name, loc, "parameter")
            t = r.table(entry, loc, required=("value",), optional=fields)
            transform = r.choice(
                t.get("transform", "identity"), at(loc, "transform"), TRANSFORMS
            )
            fixed = r.boolean(t.get("fixed", False), at(loc, "fixed"))
            per_patch = r.boolean(t.get("per_patch", False), at(loc, "per_patch"))
            lo, hi = default_bounds(transform)
            if "bounds" in t:
                bl = at(loc, "bounds")
                b = r.array(t["bounds"], bl)
                if len(b) != 2:
                    raise r.fail(bl, f"expected [lower, upper], got {len(b)} entries")
                lo = r.number(b[0], at(bl, 0), finite=False)
                hi = r.number(b[1], at(bl, 1), finite=False)
                if (why := bounds_error(transform, lo, hi)) is not None:
                    raise r.fail(bl, why)
            vl = at(loc, "value")
            raw_value = t["value"]
            if isinstance(raw_value, list | tuple):
                if not per_patch:
                    raise r.fail(
                        vl, "a list of values needs per_patch = true (one per patch)"
                    )
                values = tuple(
                    r.number(v, at(vl, j)) for j, v in enumerate(r.array(raw_value, vl))
                )
                value: float | tuple[float, ...] = values
            else:
                values = (r.number(raw_value, vl),)
                value = values[0]
            for v in values:
                if (why := value_error(transform, v, lo, hi)) is not None:
                    raise r.fail(vl, why)
            self.declare(name, "parameter", loc)
            self.symbols[name] = ("parameter", per_patch, False)
            out.append(
                ParameterSpec(name, value, transform, (lo, hi), fixed, per_patch)
            )
        return tuple(out)

    def neural_models(self) -> tuple[NeuralSpec, ...]:
        r = self.r
        out = []
        fields = (
            "layers",
            "in_size",
            "width",
            "depth",
            "activation",
            "final_activation",
            "time_input",
            "fixed",
        )
        for name, entry, loc in self.named_tables("neural"):
            name = r.identifier(name, loc, "neural sub-model")
            t = r.table(entry, loc, required=("covariate",), optional=fields)
            cl = at(loc, "covariate")
            cov = r.string(t["covariate"], cl)
            if self.covariate_dims.get(cov) not in NEURAL_DIMS:
                usable = [c for c, d in self.covariate_dims.items() if d in NEURAL_DIMS]
                raise r.fail(
                    cl,
                    f"{cov!r} is not a covariate with dims [time, patch, feature]; "
                    f"such covariates: {join(usable)}",
                )
            self.used.add(cov)
            if "layers" in t:
                for other in ("in_size", "width", "depth"):
                    if other in t:
                        raise r.fail(
                            at(loc, other),
                            "give either `layers` or `in_size`, `width` and `depth`",
                        )
                ll = at(loc, "layers")
                layers = [
                    r.integer(v, at(ll, j), 1)
                    for j, v in enumerate(r.array(t["layers"], ll))
                ]
                if len(layers) < 2 or layers[-1] != 1:
                    raise r.fail(
                        ll,
                        "layers are [in_size, hidden..., 1] and end in 1 (a scalar "
                        f"rate per patch); got {layers}",
                    )
                hidden = layers[1:-1]
                if len(set(hidden)) > 1:
                    raise r.fail(
                        ll,
                        f"hidden layers must all have the same width (eqx.nn.MLP); "
                        f"got {hidden}",
                    )
                in_size, depth = layers[0], len(hidden)
                width = hidden[0] if hidden else 0
            else:
                for req in ("in_size", "width", "depth"):
                    if req not in t:
                        raise r.fail(
                            at(loc, req),
                            f"missing required field {req!r} (or give `layers`)",
                        )
                in_size = r.integer(t["in_size"], at(loc, "in_size"), 1)
                depth = r.integer(t["depth"], at(loc, "depth"), 0)
                width = r.integer(t["width"], at(loc, "width"), 1)
                if depth == 0:
                    width = 0
            acts = []
            for key, default in (
                ("activation", "relu"),
                ("final_activation", "softplus"),
            ):
                a = r.choice(t.get(key, default), at(loc, key), tuple(ACTIVATIONS))
                acts.append(canonical_activation(a))
            time_input = r.boolean(t.get("time_input", False), at(loc, "time_input"))
            fixed = r.boolean(t.get("fixed", False), at(loc, "fixed"))
            self.declare(name, "neural sub-model", loc)
            self.symbols[name] = ("neural sub-model", True, True)
            out.append(
                NeuralSpec(
                    name,
                    cov,
                    in_size,
                    width,
                    depth,
                    acts[0],
                    acts[1],
                    time_input,
                    fixed,
                )
            )
        return tuple(out)

    def derived(self) -> tuple[DerivedSpec, ...]:
        r = self.r
        entries = self.named_tables("derived")
        for name, _, loc in entries:
            r.identifier(name, loc, "derived quantity")
            self.declare(name, "derived quantity", loc)
        for name, _, _ in entries:
            self.symbols[name] = ("derived quantity", False, False)
        allowed = ("parameter", "derived quantity")
        out = []
        deps: dict[str, frozenset[str]] = {}
        for name, entry, loc in entries:
            if isinstance(entry, Mapping):
                t = r.table(entry, loc, required=("expression",))
                entry, loc = t["expression"], at(loc, "expression")
            expr = self.expression(entry, loc, allowed, "a derived quantity")
            deps[name] = expr.names
            out.append(DerivedSpec(name, expr))
        # cycles, and per-patch-ness inherited from what a quantity reads
        state: dict[str, int] = {}

        def visit(n: str, chain: list[str]) -> bool:
            if state.get(n) == 2:
                return self.symbols[n][1]
            if state.get(n) == 1:
                cycle = " -> ".join(chain[chain.index(n) :] + [n])
                raise r.fail(at("derived", n), f"circular definition: {cycle}")
            state[n] = 1
            per_patch = False
            for d in sorted(deps[n]):
                if d in deps:
                    per_patch |= visit(d, [*chain, n])
                else:
                    per_patch |= self.symbols[d][1]
            state[n] = 2
            self.symbols[n] = ("derived quantity", per_patch, False)
            return per_patch

        for name in deps:
            visit(name, [])
        return tuple(out)

    def couplings(self) -> tuple[CouplingSpec, ...]:
        r = self.r
        out = []
        fields = ("scale", "symmetrize", "multiplier", "local")
        for name, entry, loc in self.named_tables("couplings"):
            name = r.identifier(name, loc, "coupling")
            t = r.table(entry, loc, required=("covariate",), optional=fields)
            cl = at(loc, "covariate")
            cov = r.string(t["covariate"], cl)
            if self.covariate_dims.get(cov) not in COUPLING_DIMS:
                usable = [
                    c for c, d in self.covariate_dims.items() if d in COUPLING_DIMS
                ]
                raise r.fail(
                    cl,
                    f"{cov!r} is not a covariate with dims [time, patch, patch_to] or "
                    f"[patch, patch_to]; such covariates: {join(usable)}",
                )
            self.used.add(cov)
            scale = None
            if "scale" in t:
                scale = self.expression(
                    t["scale"], at(loc, "scale"), RATE_NAMES, "a coupling scale"
                )
            symmetrize = r.boolean(t.get("symmetrize", False), at(loc, "symmetrize"))
            multiplier = r.number(t.get("multiplier", 1.0), at(loc, "multiplier"))
            local = r.number(t.get("local", 1.0), at(loc, "local"))
            self.declare(name, "coupling", loc)
            out.append(CouplingSpec(name, cov, scale, symmetrize, multiplier, local))
        self.coupling_names = [c.name for c in out]
        return tuple(out)

    def initial(self) -> tuple[InitialSpec, ...]:
        r = self.r
        raw = self.raw.get("initial", {})
        if not isinstance(raw, Mapping):
            raise r.fail("initial", f"expected a table, got {describe_type(raw)}")
        out = []
        allowed = ("parameter", "derived quantity", "covariate")
        for comp, entry in raw.items():
            loc = at("initial", str(comp))
            self.compartment(comp, loc)
            if isinstance(entry, Mapping):
                t = r.table(entry, loc, optional=("expression", "data"))
                if ("expression" in t) == ("data" in t):
                    raise r.fail(loc, "give exactly one of `expression` and `data`")
                if "data" in t:
                    out.append(
                        InitialSpec(comp, data=r.string(t["data"], at(loc, "data")))
                    )
                    continue
                entry, loc = t["expression"], at(loc, "expression")
            expr = self.expression(entry, loc, allowed, "an initial condition")
            for n in expr.names:
                if self.symbols[n][0] == "covariate" and self.symbols[n][2]:
                    raise r.fail(
                        loc,
                        f"covariate {n!r} varies in time; initial conditions may use "
                        "covariates with dims [patch] only",
                    )
            out.append(InitialSpec(comp, expression=expr))
        return tuple(out)


def spec_from_dict(
    data: Any, *, file: str | None = None, default_name: str | None = None
) -> ModelSpec:
    """Validate a raw model description (as `tomllib` returns it).

    Args:
        data: nested dicts/lists in the TOML layout (see `docs/models.md`).
        file: where it came from, named in error messages.
        default_name: the model name when `name` is absent (a file's stem).

    Raises:
        ModelSpecError: naming the file, the field path and what is wrong.
    """
    return Validator(data, file, default_name).run()
