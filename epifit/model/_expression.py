"""Whitelisted arithmetic expressions of parameters.

Model text is parsed with Python's `ast` module into a small tree of tuples, each
node checked against a whitelist, and evaluated by walking that tree with `jnp`.
Nothing is ever passed to `eval`, `exec` or `compile`.

Depth counts nesting, not length: a left-associative chain such as
`a + b - c + ...` or `a * b / c` is one node of the tree (`"chain"`), however
many terms it has, so a long flat sum is accepted while 65 nested parentheses or
unary minuses are not. Walking, evaluating and folding recurse only into
nested operands, so their recursion depth is bounded by `MAX_DEPTH`.

[`fold`][] evaluates the parts of an expression that are constant (numbers and
names of known constant values) with NumPy at load time, so that a rate such as
`gamma / 0` or `exp(1000)` is refused when the model is read, not when a fit
meets an infinite rate.
"""

from __future__ import annotations

import ast
import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from epifit.model._errors import ModelSpecError

__all__ = ["FUNCTIONS", "Expression", "fold", "parse_expression"]

MAX_LENGTH = 2000
MAX_DEPTH = 64


def _reduce(op: Callable) -> Callable:
    def f(*args):
        out = args[0]
        for a in args[1:]:
            out = op(out, a)
        return out

    return f


# name -> (minimum number of arguments, maximum or None, implementation)
FUNCTIONS: dict[str, tuple[int, int | None, Callable[..., Array]]] = {
    "exp": (1, 1, jnp.exp),
    "log": (1, 1, jnp.log),
    "log1p": (1, 1, jnp.log1p),
    "expm1": (1, 1, jnp.expm1),
    "sqrt": (1, 1, jnp.sqrt),
    "softplus": (1, 1, jax.nn.softplus),
    "sigmoid": (1, 1, jax.nn.sigmoid),
    "abs": (1, 1, jnp.abs),
    "min": (2, None, _reduce(jnp.minimum)),
    "max": (2, None, _reduce(jnp.maximum)),
}

# the operators of a left-associative chain: one group per precedence level
_CHAIN_GROUP = {ast.Add: 0, ast.Sub: 0, ast.Mult: 1, ast.Div: 1}
_BINARY = {
    ast.Add: "add",
    ast.Sub: "sub",
    ast.Mult: "mul",
    ast.Div: "div",
    ast.Pow: "pow",
}
_BINARY_IMPL: dict[str, Callable[[Any, Any], Any]] = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b,
    "pow": lambda a, b: a**b,
}
ALLOWED = "numbers, names, unary -, + - * / **, parentheses and calls to " + ", ".join(
    FUNCTIONS
)


@dataclasses.dataclass(frozen=True)
class Expression:
    """A parsed, whitelisted expression.

    Two expressions are equal when their trees are equal, whatever the spacing of
    their source text (`"a*b"` equals `"a * b"`).

    Attributes:
        tree: nested tuples: `("num", x)`, `("name", n)`, `("neg", t)`,
            `("pow", a, b)`, `("call", f, args)`, and `("chain", first,
            ((op, operand), ...))` for a left-associative chain of `op` in
            add/sub/mul/div (`a - b + c` is `first = a`, then `(sub, b)`,
            `(add, c)`), evaluated left to right.
        source: the text it was parsed from.
        names: the parameter/derived/input names it reads.
    """

    tree: tuple
    source: str = dataclasses.field(default="", compare=False)
    names: frozenset[str] = dataclasses.field(default=frozenset(), compare=False)

    def __str__(self) -> str:
        return self.source

    def evaluate(self, env: Mapping[str, Any], *, safe_division: bool = False) -> Array:
        """Evaluate with `jnp`, reading names from `env`. With
        `safe_division`, `a / b` is 0 (with zero derivatives) where `b` is
        exactly 0 (the rates that read the state: `doses / S` at `S = 0`).

        Examples:
            >>> e = parse_expression("-log(-expm1(-k * a)) / g")
            >>> round(float(e.evaluate({"k": 0.5, "a": 0.07, "g": 1.5})), 4)
            2.2466
        """
        ops = _SAFE_IMPL if safe_division else _BINARY_IMPL
        return jnp.asarray(_evaluate(self.tree, env, ops))


def _divide(a, b):
    """`a / b`, 0 where `b == 0` (the double `where`: finite derivatives)."""
    zero = b == 0
    return jnp.where(zero, 0.0, a / jnp.where(zero, 1.0, b))


_SAFE_IMPL = {**_BINARY_IMPL, "div": _divide}


def _evaluate(node: tuple, env: Mapping[str, Any], ops) -> Any:
    kind = node[0]
    if kind == "num":
        return jnp.asarray(node[1])  # weakly typed: never promotes float32 inputs
    if kind == "name":
        return env[node[1]]
    if kind == "neg":
        return -_evaluate(node[1], env, ops)
    if kind == "call":
        return FUNCTIONS[node[1]][2](*(_evaluate(a, env, ops) for a in node[2]))
    if kind == "chain":
        out = _evaluate(node[1], env, ops)
        for op, operand in node[2]:
            out = ops[op](out, _evaluate(operand, env, ops))
        return out
    return ops[kind](_evaluate(node[1], env, ops), _evaluate(node[2], env, ops))


def parse_expression(
    text: str | int | float,
    *,
    file: str | None = None,
    location: str | None = None,
) -> Expression:
    """Parse model text into a whitelisted [`Expression`][].

    Args:
        text: the expression, e.g. `"-log(-expm1(-kappa*alpha))/gamma"`, or a number.
        file: the file it came from, for error messages.
        location: its table/field path, for error messages.

    Returns:
        The parsed expression; its `names` still have to be checked against the
        model's namespace by the caller.

    Raises:
        ModelSpecError: for syntax errors and anything outside the whitelist
            (attributes, subscripts, lambdas, strings, unknown functions, ...),
            naming the offending token.

    Examples:
        >>> sorted(parse_expression("N - I0").names)
        ['I0', 'N']
    """

    def fail(reason: str) -> ModelSpecError:
        return ModelSpecError(reason, file=file, location=location)

    text = _source_text(text, fail)
    try:
        module = ast.parse(text.strip(), mode="eval")
    except SyntaxError as e:
        col = f" at column {e.offset}" if e.offset else ""
        raise fail(
            f"invalid expression {text!r}: syntax error{col} ({e.msg})"
        ) from None
    except (ValueError, RecursionError, MemoryError) as e:
        raise fail(f"invalid expression {text!r}: {e}") from None
    walker = _Walker(text, fail)
    try:
        tree = walker.walk(module.body, 0)
    except RecursionError:
        raise fail(f"expression {text!r} is nested too deeply") from None
    return Expression(tree=tree, source=walker.source, names=frozenset(walker.names))


def _source_text(text: Any, fail: Callable[[str], ModelSpecError]) -> str:
    """The text of an expression given as a string or a finite number."""
    if isinstance(text, bool) or not isinstance(text, str | int | float):
        raise fail(
            f"expected an expression (a string or a number), got "
            f"{type(text).__name__} {text!r}"
        )
    if not isinstance(text, str):
        if not math.isfinite(text):
            raise fail(f"number {text!r} is not finite")
        text = repr(float(text))
    if len(text) > MAX_LENGTH:
        raise fail(f"expression is longer than {MAX_LENGTH} characters")
    if not text.strip():
        raise fail("empty expression")
    return text


class _Walker:
    """Checks a parsed `ast` against the whitelist and converts it to the tuple
    tree of an [`Expression`][], collecting the names it reads."""

    def __init__(self, text: str, fail: Callable[[str], ModelSpecError]):
        self.text = text
        self.source = text.strip()
        self.fail = fail
        self.names: set[str] = set()

    def token(self, node: ast.AST) -> str:
        segment = ast.get_source_segment(self.source, node)
        return segment if segment is not None else type(node).__name__

    def walk(self, node: ast.AST, depth: int) -> tuple:
        text, fail = self.text, self.fail
        if depth > MAX_DEPTH:
            raise fail(f"expression {text!r} is nested more than {MAX_DEPTH} deep")
        if isinstance(node, ast.Constant):
            return self.constant(node)
        if isinstance(node, ast.Name):
            if node.id in FUNCTIONS:
                raise fail(
                    f"invalid expression {text!r}: function {node.id!r} must be "
                    f"called, e.g. {node.id}(x)"
                )
            self.names.add(node.id)
            return ("name", node.id)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            inner = self.walk(node.operand, depth + 1)
            return ("neg", inner) if isinstance(node.op, ast.USub) else inner
        if isinstance(node, ast.BinOp) and type(node.op) in _CHAIN_GROUP:
            return self.chain(node, depth)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            return (
                _BINARY[type(node.op)],
                self.walk(node.left, depth + 1),
                self.walk(node.right, depth + 1),
            )
        if isinstance(node, ast.Call):
            return self.call(node, depth)
        raise fail(
            f"invalid expression {text!r}: {self.token(node)!r} "
            f"({type(node).__name__}) is not allowed; allowed: {ALLOWED}"
        )

    def chain(self, node: ast.BinOp, depth: int) -> tuple:
        """A left-associative chain `a + b - c` (or `a * b / c`) as one node:
        its terms are one level deeper, however many there are. Walks the left
        spine iteratively, so a long chain does not recurse."""
        group = _CHAIN_GROUP[type(node.op)]
        ops = []
        while isinstance(node, ast.BinOp) and _CHAIN_GROUP.get(type(node.op)) == group:
            ops.append((_BINARY[type(node.op)], node.right))
            node = node.left
        first = self.walk(node, depth + 1)
        rest = tuple((op, self.walk(right, depth + 1)) for op, right in reversed(ops))
        return ("chain", first, rest)

    def constant(self, node: ast.Constant) -> tuple:
        text, fail = self.text, self.fail
        value = node.value
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise fail(
                f"invalid expression {text!r}: {self.token(node)!r} is not allowed; "
                f"allowed: {ALLOWED}"
            )
        try:
            number = float(value)
        except OverflowError:
            raise fail(f"number {self.token(node)!r} is too large") from None
        if not math.isfinite(number):
            raise fail(f"number {self.token(node)!r} is not finite")
        return ("num", number)

    def call(self, node: ast.Call, depth: int) -> tuple:
        text, fail = self.text, self.fail
        func = node.func
        if not isinstance(func, ast.Name):
            raise fail(
                f"invalid expression {text!r}: call of {self.token(func)!r} is not "
                f"allowed; allowed functions: {', '.join(FUNCTIONS)}"
            )
        if func.id not in FUNCTIONS:
            raise fail(
                f"invalid expression {text!r}: unknown function {func.id!r}; "
                f"allowed functions: {', '.join(FUNCTIONS)}"
            )
        if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
            raise fail(
                f"invalid expression {text!r}: {self.token(node)!r}: functions take "
                "positional arguments only"
            )
        lo, hi, _ = FUNCTIONS[func.id]
        n = len(node.args)
        if n < lo or (hi is not None and n > hi):
            want = str(lo) if hi == lo else f"at least {lo}"
            raise fail(
                f"invalid expression {text!r}: {func.id}() takes {want} "
                f"argument(s), got {n}"
            )
        return ("call", func.id, tuple(self.walk(a, depth + 1) for a in node.args))


# -- folding constant parts at load time --------------------------------------------
_NP_FUNCTIONS: dict[str, Callable[..., np.ndarray]] = {
    "exp": np.exp,
    "log": np.log,
    "log1p": np.log1p,
    "expm1": np.expm1,
    "sqrt": np.sqrt,
    "softplus": lambda x: np.logaddexp(0.0, x),
    "sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)),
    "abs": np.abs,
    "min": _reduce(np.minimum),
    "max": _reduce(np.maximum),
}


class _NotFinite(Exception):
    def __init__(self, reason: str):
        self.reason = reason


def fold(
    expr: Expression, env: Mapping[str, Any]
) -> tuple[np.ndarray | None, str | None]:
    """Evaluate the constant parts of `expr` with NumPy (`float64`).

    A part is constant when it reads only numbers and names in `env` (known
    constant values: fixed parameters, derived quantities of them).

    Returns:
        `(value, problem)`: `value` the whole expression's value when it is
        constant (else `None`); `problem` a sentence saying which constant part
        is not finite (`"'exp(1000)' is inf"`) or divides by a constant zero
        (`"'gamma / 0' divides by zero"`), else `None`.

    Examples:
        >>> fold(parse_expression("2 * a"), {"a": 1.5})[0].item()
        3.0
        >>> fold(parse_expression("gamma / 0"), {})
        (None, "'gamma / 0' divides by zero")
    """
    try:
        with np.errstate(all="ignore"):
            return _fold(expr.tree, env), None
    except _NotFinite as e:
        return None, e.reason
    except (ValueError, TypeError):  # shapes that do not broadcast: not folded
        return None, None


def _fold(node: tuple, env: Mapping[str, Any]) -> np.ndarray | None:
    kind = node[0]
    if kind == "num":
        return np.float64(node[1])
    if kind == "name":
        v = env.get(node[1])
        return None if v is None else np.asarray(v, np.float64)
    if kind == "neg":
        v = _fold(node[1], env)
        return None if v is None else -v
    if kind == "call":
        args = [_fold(a, env) for a in node[2]]
        if any(a is None for a in args):
            return None
        return _finite(node, _NP_FUNCTIONS[node[1]](*args))
    if kind == "chain":
        out = _fold(node[1], env)
        for j, (op, operand) in enumerate(node[2]):
            v = _fold(operand, env)
            if op == "div" and v is not None and (v == 0).any():
                part = ("chain", node[1], node[2][: j + 1])
                raise _NotFinite(f"{_text(part)!r} divides by zero")
            out = None if out is None or v is None else _BINARY_IMPL[op](out, v)
            if out is not None:
                _finite(("chain", node[1], node[2][: j + 1]), out)
        return out
    a, b = _fold(node[1], env), _fold(node[2], env)
    return None if a is None or b is None else _finite(node, a**b)


def _finite(node: tuple, value: np.ndarray) -> np.ndarray:
    if not np.isfinite(value).all():
        bad = np.ravel(value)[~np.isfinite(np.ravel(value))][0]
        raise _NotFinite(f"{_text(node)!r} is {bad}")
    return value


def _text(node: tuple) -> str:
    """The expression of `node` as text, for messages."""
    kind = node[0]
    if kind == "num":
        x = node[1]
        return str(int(x)) if x.is_integer() and abs(x) < 1e15 else repr(x)
    if kind == "name":
        return node[1]
    if kind == "neg":
        return f"-{_operand(node[1])}"
    if kind == "call":
        return f"{node[1]}({', '.join(_text(a) for a in node[2])})"
    symbols = {"add": "+", "sub": "-", "mul": "*", "div": "/", "pow": "**"}
    if kind == "chain":
        parts = [_operand(node[1])]
        parts += [f"{symbols[op]} {_operand(x)}" for op, x in node[2]]
        return " ".join(parts)
    return f"{_operand(node[1])} ** {_operand(node[2])}"


def _operand(node: tuple) -> str:
    text = _text(node)
    return text if node[0] in ("num", "name", "call") else f"({text})"
