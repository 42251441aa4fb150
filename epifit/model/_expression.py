"""Whitelisted arithmetic expressions of parameters.

Model text is parsed with Python's `ast` module into a small tree of tuples, each
node checked against a whitelist, and evaluated by walking that tree with `jnp`.
Nothing is ever passed to `eval`, `exec` or `compile`.
"""

from __future__ import annotations

import ast
import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array

from epifit.model._errors import ModelSpecError

__all__ = ["FUNCTIONS", "Expression", "parse_expression"]

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
            `(op, a, b)` for `op` in add/sub/mul/div/pow, `("call", f, args)`.
        source: the text it was parsed from.
        names: the parameter/derived/input names it reads.
    """

    tree: tuple
    source: str = dataclasses.field(default="", compare=False)
    names: frozenset[str] = dataclasses.field(default=frozenset(), compare=False)

    def __str__(self) -> str:
        return self.source

    def evaluate(self, env: Mapping[str, Any]) -> Array:
        """Evaluate with `jnp`, reading names from `env`.

        Examples:
            >>> e = parse_expression("-log(-expm1(-k * a)) / g")
            >>> round(float(e.evaluate({"k": 0.5, "a": 0.07, "g": 1.5})), 4)
            2.2466
        """
        return jnp.asarray(_evaluate(self.tree, env))


def _evaluate(node: tuple, env: Mapping[str, Any]) -> Any:
    kind = node[0]
    if kind == "num":
        return jnp.asarray(node[1])  # weakly typed: never promotes float32 inputs
    if kind == "name":
        return env[node[1]]
    if kind == "neg":
        return -_evaluate(node[1], env)
    if kind == "call":
        return FUNCTIONS[node[1]][2](*(_evaluate(a, env) for a in node[2]))
    return _BINARY_IMPL[kind](_evaluate(node[1], env), _evaluate(node[2], env))


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
