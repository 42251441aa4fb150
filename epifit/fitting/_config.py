"""Fit configuration: `FIT.toml` files and their Python twins (dicts).

A fit configuration says how to fit, never what the model is: optimiser phases,
tolerances and budgets, multi-start, checkpointing, uncertainty, and overrides of
the model's parameters (initial value, fixed/free, transform, bounds, a prior or
an L2 penalty). Every field is optional. See `docs/calibration.md`.

Every problem raises [`FitConfigError`][] naming the file (or `"fit"` for a
dict), the field path and what is wrong, e.g.
`models/sir_fit.toml: phases[1].method: unknown value 'bfgs'; expected one of: ...`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import optax

from epifit._errors import LocatedError
from epifit._toml import Reader, at, join
from epifit.model import NEURAL_FIXED, TRANSFORMS, bounds_error
from epifit.ode import AbstractAdaptiveSolver
from epifit.simulation import ADJOINTS as ADJOINT_CLASSES
from epifit.simulation import SOLVERS as SOLVER_CLASSES

__all__ = [
    "FitConfig",
    "FitConfigError",
    "MAX_STARTS",
    "ParameterOverride",
    "PhaseConfig",
    "PriorConfig",
    "load_fit_config",
    "parse_fit_config",
    "parse_phases",
]


class FitConfigError(LocatedError):
    """An invalid fit configuration; the message names file, field and fix."""


class _Reader(Reader):
    error = FitConfigError

    def positive(self, value: Any, location: str) -> float:
        x = self.number(value, location)
        if x <= 0:
            raise self.fail(location, f"must be > 0, got {value}")
        return x

    def nonnegative(self, value: Any, location: str) -> float:
        x = self.number(value, location)
        if x < 0:
            raise self.fail(location, f"must be >= 0, got {value}")
        return x

    def fraction(self, value: Any, location: str) -> float:
        x = self.number(value, location)
        if not 0.0 < x < 1.0:
            raise self.fail(location, f"must lie strictly between 0 and 1, got {value}")
        return x


FIRST_ORDER = ("adam", "rmsprop", "sgd")
METHODS = (*FIRST_ORDER, "lbfgs", "levenberg_marquardt", "gauss_newton")
ALIASES = {"lm": "levenberg_marquardt", "l-bfgs": "lbfgs", "gn": "gauss_newton"}
SCHEDULES = ("constant", "cosine", "exponential", "warmup_cosine")
# the method of a phase given as an optax transformation (Python API only)
OPTAX = "optax"
ADJOINTS = tuple(ADJOINT_CLASSES)
# the adaptive solvers: a fit file gives tolerances, not a step-size controller
SOLVERS = tuple(
    name
    for name, cls in SOLVER_CLASSES.items()
    if issubclass(cls, AbstractAdaptiveSolver)
)
UNCERTAINTY_METHODS = ("auto", "hessian", "gauss_newton", "none")
NOISE = ("auto", "estimate", "known")
PRIORS = ("normal", "lognormal", "flat")

_COMMON = ("method", "iterations", "tolerance", "loss_tolerance", "patience")
_SCHEDULE = (
    "learning_rate",
    "schedule",
    "decay_rate",
    "transition_steps",
    "warmup_steps",
    "final_fraction",
    "clip",
)
PHASE_FIELDS = {
    "adam": (*_COMMON, *_SCHEDULE, "b1", "b2", "eps"),
    "rmsprop": (*_COMMON, *_SCHEDULE, "decay", "eps", "momentum", "centered"),
    "sgd": (*_COMMON, *_SCHEDULE, "momentum", "nesterov"),
    "lbfgs": (*_COMMON, "memory_size", "max_linesearch_steps"),
    "levenberg_marquardt": (*_COMMON, "damping"),
    "gauss_newton": (*_COMMON,),
}
TOP_LEVEL = (
    "description",
    "n_starts",
    "seed",
    "perturbation",
    "max_iterations",
    "tolerance",
    "loss_tolerance",
    "patience",
    "time_budget",
    "rtol",
    "atol",
    "max_steps",
    "adjoint",
    "solver",
    "interpolate_saves",
    "checkpoint_every",
    "chunk_size",
    "max_retreats",
    "parameters",
    "phases",
    "uncertainty",
)


@dataclasses.dataclass(frozen=True)
class PhaseConfig:
    """One optimiser phase. `options` holds the method's own settings (learning
    rate, schedule, momentum, memory size, damping, ...); a phase of method
    `"optax"` holds its `optax.GradientTransformation` as option `transform`."""

    method: str
    iterations: int = 200
    tolerance: float | None = None
    loss_tolerance: float | None = None
    patience: int | None = None
    options: tuple[tuple[str, Any], ...] = ()

    def option(self, name: str, default: Any = None) -> Any:
        return dict(self.options).get(name, default)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"method": self.method, "iterations": self.iterations}
        for k in ("tolerance", "loss_tolerance", "patience"):
            if getattr(self, k) is not None:
                out[k] = getattr(self, k)
        out.update({k: _plain_option(v) for k, v in self.options})
        return out


def _plain_option(value: Any) -> Any:
    """An option as a plain value. An optax transformation is a pair of
    functions with nothing stable to record: it is named by its kind only (so
    a checkpoint's fingerprint cannot tell two of them apart)."""
    if isinstance(value, optax.GradientTransformation):
        return "optax.GradientTransformation"
    return value


@dataclasses.dataclass(frozen=True)
class PriorConfig:
    """A prior on the constrained value: `normal` (`mean`, `sd`) or `lognormal`
    (`median`, `sdlog`: `log(value)` is normal with mean `log(median)`), or
    `flat` (improper, on the unconstrained scale; `a`, `b` unused). On a
    neural sub-model, `normal` applies to every weight and bias."""

    family: str
    a: float
    b: float


@dataclasses.dataclass(frozen=True)
class ParameterOverride:
    """Fit-time changes to one model parameter (or neural sub-model)."""

    value: float | tuple[float, ...] | None = None
    fixed: bool | str | None = None
    transform: str | None = None
    bounds: tuple[float, float] | None = None
    prior: PriorConfig | None = None
    l2: float | None = None


@dataclasses.dataclass(frozen=True)
class FitConfig:
    """A parsed fit configuration. `None` means "not set here"."""

    source: str | None = None
    raw: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False)
    n_starts: int | None = None
    seed: int | None = None
    perturbation: float | None = None
    max_iterations: int | None = None
    tolerance: float | None = None
    loss_tolerance: float | None = None
    patience: int | None = None
    time_budget: float | None = None
    rtol: float | None = None
    atol: float | None = None
    max_steps: int | None = None
    adjoint: str | None = None
    solver: str | None = None
    interpolate_saves: bool | None = None
    checkpoint_every: int | None = None
    chunk_size: int | None = None
    max_retreats: int | None = None
    parameters: Mapping[str, ParameterOverride] = dataclasses.field(
        default_factory=dict
    )
    phases: tuple[PhaseConfig, ...] | None = None
    uncertainty: str | None = None
    level: float | None = None
    noise: str | None = None


def load_fit_config(path: str | os.PathLike) -> FitConfig:
    """Read and validate a `FIT.toml` file."""
    path = Path(path)
    data = _Reader(str(path)).toml_file(path, "Fit configuration")
    return parse_fit_config(data, file=str(path))


def parse_fit_config(data: Mapping[str, Any], *, file: str = "fit") -> FitConfig:
    """Validate a fit configuration given as a (TOML-shaped) mapping."""
    r = _Reader(file)
    t = r.table(data, None, optional=TOP_LEVEL)
    kw: dict[str, Any] = {
        key: _check_field(r, key, t[key], key) for key in SETTINGS if key in t
    }
    if "description" in t:
        r.string(t["description"], "description")
    if "adjoint" in t:
        kw["adjoint"] = r.choice(t["adjoint"], "adjoint", ADJOINTS)
    if "solver" in t:
        kw["solver"] = r.choice(t["solver"], "solver", SOLVERS)
    if "interpolate_saves" in t:
        kw["interpolate_saves"] = r.boolean(t["interpolate_saves"], "interpolate_saves")
    if "parameters" in t:
        kw["parameters"] = _parameters(r, t["parameters"])
    if "phases" in t:
        kw["phases"] = _phases(r, t["phases"], "phases")
    if "uncertainty" in t:
        u = r.table(
            t["uncertainty"], "uncertainty", optional=("method", "level", "noise")
        )
        if "method" in u:
            kw["uncertainty"] = r.choice(
                u["method"], "uncertainty.method", UNCERTAINTY_METHODS
            )
        if "level" in u:
            kw["level"] = _check_field(r, "level", u["level"], "uncertainty.level")
        if "noise" in u:
            kw["noise"] = r.choice(u["noise"], "uncertainty.noise", NOISE)
    return FitConfig(source=file, raw=dict(data), **kw)


# the numeric settings a fit file and `calibrate`'s keywords share, and the
# one check of each: (kind, minimum) for integers, else the kind of number
SETTINGS: dict[str, tuple[str, int | None]] = {
    "n_starts": ("integer", 1),
    "max_iterations": ("integer", 1),
    "checkpoint_every": ("integer", 1),
    "chunk_size": ("integer", 1),
    "patience": ("integer", 1),
    "max_retreats": ("integer", 1),
    "max_steps": ("integer", 1),
    "seed": ("integer", 0),
    "perturbation": ("nonnegative", None),
    "tolerance": ("nonnegative", None),
    "loss_tolerance": ("nonnegative", None),
    "time_budget": ("positive", None),
    "rtol": ("positive", None),
    "atol": ("positive", None),
}
# `level` lives in the [uncertainty] table of a fit file
_LEVEL = ("fraction", None)
# starting points one fit may have: each is an optimisation of its own (a
# solve and a gradient per iteration, a state per start in batched calls)
MAX_STARTS = 10_000


def _check_field(r: _Reader, key: str, value: Any, location: str) -> Any:
    """The one check of setting `key` (see `SETTINGS`)."""
    kind, minimum = SETTINGS.get(key, _LEVEL)
    if kind == "integer":
        out = r.integer(value, location, minimum)
        if key == "n_starts" and out > MAX_STARTS:
            raise r.fail(
                location,
                f"{out} starting points are more than {MAX_STARTS}: each is an "
                f"optimisation of its own ({out} x the iterations of every phase "
                "in solves with gradients); use fewer starts",
            )
        return out
    return getattr(r, kind)(value, location)


def check_setting(key: str, value: Any, location: str, *, file: str) -> Any:
    """The check of setting `key` (`SETTINGS`, or `level`) that a fit file's
    field gets, for a value given elsewhere (raises `FitConfigError`)."""
    return _check_field(_Reader(file), key, value, location)


PhasesLike = str | Mapping[str, Any] | optax.GradientTransformation | Sequence[Any]
"""What `calibrate(optimizer=...)` accepts (see `parse_phases`)."""


def parse_phases(
    value: PhasesLike,
    *,
    file: str = "calibrate",
) -> tuple[PhaseConfig, ...]:
    """Phases from the Python API: a method name (`"lbfgs"`), an
    `optax.GradientTransformation` (a first-order phase like `"adam"`), one
    phase as a dict (whose `method` may be a transformation), or a list of them
    (`[optax.adam(1e-2), {"method": "lbfgs", "iterations": 50}]`)."""
    r = _Reader(file)
    # a transformation is a tuple (of functions): test for it before sequences
    if isinstance(value, str | Mapping | optax.GradientTransformation):
        value = [value]
    return _phases(r, value, "optimizer")


def _phases(r: _Reader, value: Any, location: str) -> tuple[PhaseConfig, ...]:
    items = r.array(value, location)
    return tuple(
        _phase(
            r,
            {"method": item}
            if isinstance(item, str | optax.GradientTransformation)
            else item,
            at(location, j),
        )
        for j, item in enumerate(items)
    )


def _common(r: _Reader, t: Mapping[str, Any], loc: str) -> tuple[int, dict]:
    """A phase's iterations and the stopping rules every method has."""
    iterations = r.integer(t.get("iterations", 200), at(loc, "iterations"), 1)
    common: dict[str, Any] = {}
    for key in ("tolerance", "loss_tolerance"):
        if key in t:
            common[key] = r.nonnegative(t[key], at(loc, key))
    if "patience" in t:
        common["patience"] = r.integer(t["patience"], at(loc, "patience"), 1)
    return iterations, common


def _phase(r: _Reader, value: Any, loc: str) -> PhaseConfig:
    if not isinstance(value, Mapping):
        raise r.fail(loc, f"expected a table with a 'method', got {value!r}")
    if "method" not in value:
        raise r.fail(at(loc, "method"), "missing required field 'method'")
    method = value["method"]
    if isinstance(method, optax.GradientTransformation):
        t = r.table(value, loc, required=("method",), optional=_COMMON)
        iterations, common = _common(r, t, loc)
        return PhaseConfig(
            OPTAX, iterations, options=(("transform", method),), **common
        )
    if isinstance(method, str):
        method = ALIASES.get(method.lower(), method.lower())
    method = r.choice(method, at(loc, "method"), METHODS)
    t = r.table(value, loc, required=("method",), optional=PHASE_FIELDS[method])
    iterations, common = _common(r, t, loc)
    opts: dict[str, Any] = {}
    for key in ("learning_rate", "eps", "damping", "clip", "final_fraction"):
        if key in t:
            check = r.nonnegative if key == "damping" else r.positive
            opts[key] = check(t[key], at(loc, key))
    for key in ("b1", "b2", "decay", "momentum", "decay_rate"):
        if key in t:
            x = r.number(t[key], at(loc, key))
            if not 0.0 <= x < 1.0 and not (key == "decay_rate" and 0.0 < x):
                raise r.fail(at(loc, key), f"must lie in [0, 1), got {t[key]}")
            opts[key] = x
    for key in ("transition_steps", "warmup_steps", "memory_size"):
        if key in t:
            opts[key] = r.integer(t[key], at(loc, key), 1)
    if "max_linesearch_steps" in t:
        opts["max_linesearch_steps"] = r.integer(
            t["max_linesearch_steps"], at(loc, "max_linesearch_steps"), 1
        )
    for key in ("centered", "nesterov"):
        if key in t:
            opts[key] = r.boolean(t[key], at(loc, key))
    if "schedule" in t:
        opts["schedule"] = r.choice(t["schedule"], at(loc, "schedule"), SCHEDULES)
        if opts["schedule"] == "warmup_cosine" and "warmup_steps" not in opts:
            raise r.fail(
                at(loc, "warmup_steps"),
                "schedule 'warmup_cosine' needs warmup_steps (e.g. warmup_steps = 20)",
            )
    if "final_fraction" in opts and opts["final_fraction"] > 1:
        raise r.fail(at(loc, "final_fraction"), "must be <= 1")
    return PhaseConfig(
        method, iterations, options=tuple(sorted(opts.items())), **common
    )


def _parameters(r: _Reader, value: Any) -> dict[str, ParameterOverride]:
    if not isinstance(value, Mapping):
        raise r.fail("parameters", f"expected a table, got {value!r}")
    table = dict(value)
    out = {}
    fields = ("value", "fixed", "transform", "bounds", "prior", "l2")
    for name, entry in table.items():
        loc = at("parameters", str(name))
        t = r.table(entry, loc, optional=fields)
        kw: dict[str, Any] = {}
        if "fixed" in t:
            kw["fixed"] = r.boolean_or(t["fixed"], at(loc, "fixed"), NEURAL_FIXED)
        if "transform" in t:
            kw["transform"] = r.choice(t["transform"], at(loc, "transform"), TRANSFORMS)
        if "bounds" in t:
            bl = at(loc, "bounds")
            b = r.array(t["bounds"], bl)
            if len(b) != 2:
                raise r.fail(bl, f"expected [lower, upper], got {len(b)} entries")
            lo = r.number(b[0], at(bl, 0), finite=False)
            hi = r.number(b[1], at(bl, 1), finite=False)
            if "transform" in kw and (why := bounds_error(kw["transform"], lo, hi)):
                raise r.fail(bl, why)
            kw["bounds"] = (lo, hi)
        if "value" in t:
            vl = at(loc, "value")
            v = t["value"]
            if isinstance(v, list | tuple):
                kw["value"] = tuple(
                    r.number(x, at(vl, j)) for j, x in enumerate(r.array(v, vl))
                )
            else:
                kw["value"] = r.number(v, vl)
        if "l2" in t:
            kw["l2"] = r.nonnegative(t["l2"], at(loc, "l2"))
        if "prior" in t:
            kw["prior"] = _prior(r, t["prior"], at(loc, "prior"))
        out[str(name)] = ParameterOverride(**kw)
    return out


def _prior(r: _Reader, value: Any, loc: str) -> PriorConfig:
    if not isinstance(value, Mapping):
        raise r.fail(
            loc,
            'expected a table such as { family = "normal", mean = 2.0, sd = 0.5 }, '
            f"got {value!r}",
        )
    family = r.choice(value.get("family", "normal"), at(loc, "family"), PRIORS)
    if family == "flat":  # improper, on the unconstrained scale: no numbers
        r.table(value, loc, optional=("family",))
        return PriorConfig(family, 0.0, 1.0)
    keys = ("mean", "sd") if family == "normal" else ("median", "sdlog")
    t = r.table(value, loc, required=keys, optional=("family",))
    a = r.number(t[keys[0]], at(loc, keys[0]))
    if family == "lognormal" and a <= 0:
        raise r.fail(at(loc, "median"), f"must be > 0, got {t['median']}")
    b = r.positive(t[keys[1]], at(loc, keys[1]))
    return PriorConfig(family, a, b)


def merge(config: FitConfig, **overrides: Any) -> FitConfig:
    """`config` with every override that is not `None` applied (keyword
    arguments of `calibrate` win over the file)."""
    return dataclasses.replace(
        config, **{k: v for k, v in overrides.items() if v is not None}
    )


def known_names(config: FitConfig, names: Sequence[str], model: str) -> None:
    """Raise if the configuration overrides a parameter the model lacks."""
    unknown = sorted(set(config.parameters) - set(names))
    if unknown:
        raise FitConfigError(
            f"unknown parameter(s) {join(unknown)}; model '{model}' has {join(names)}",
            file=config.source,
            location="parameters",
        )
