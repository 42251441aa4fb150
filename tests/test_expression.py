"""The whitelist expression parser."""

import math

import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from epifit.model import ModelSpecError, parse_expression


@pytest.mark.parametrize(
    ("text", "env", "expected"),
    [
        ("1 + 2 * 3", {}, 7.0),
        ("2 ** 3 ** 2", {}, 512.0),  # ** is right-associative, as in Python
        ("-a ** 2", {"a": 3.0}, -9.0),  # unary minus binds looser than **
        ("(a - b) / c", {"a": 5.0, "b": 1.0, "c": 8.0}, 0.5),
        ("+a", {"a": 2.5}, 2.5),
        ("1e-3 * N", {"N": 763.0}, 0.763),
        ("exp(log(a))", {"a": 4.0}, 4.0),
        ("log1p(a) - log(1 + a)", {"a": 0.5}, 0.0),
        ("expm1(a)", {"a": 1e-10}, 1.00000000005e-10),
        ("sqrt(a)", {"a": 2.25}, 1.5),
        ("softplus(a)", {"a": 0.3}, math.log1p(math.exp(0.3))),
        ("sigmoid(a)", {"a": 0.3}, 1 / (1 + math.exp(-0.3))),
        ("abs(-a)", {"a": 2.0}, 2.0),
        ("min(a, b, 3)", {"a": 5.0, "b": 4.0}, 3.0),
        ("max(a, b)", {"a": 5.0, "b": 4.0}, 5.0),
        (
            "-log(-expm1(-kappa * alpha)) / gamma",
            {"kappa": 0.5, "alpha": 0.07, "gamma": 1.5},
            -math.log(-math.expm1(-0.035)) / 1.5,
        ),
    ],
)
def test_evaluates_like_python_math(text, env, expected):
    e = parse_expression(text)
    assert e.names == frozenset(env)
    np.testing.assert_allclose(e.evaluate(env), expected, rtol=1e-14)


def test_per_patch_arrays_broadcast():
    e = parse_expression("N - I0")
    out = e.evaluate({"N": jnp.array([10.0, 20.0]), "I0": 1.0})
    np.testing.assert_array_equal(out, [9.0, 19.0])


def test_numbers_are_accepted_as_expressions():
    assert parse_expression(0.5) == parse_expression("0.5")
    assert float(parse_expression(3).evaluate({})) == 3.0


def test_equality_ignores_spacing_not_structure():
    assert parse_expression("a*b + 1") == parse_expression("a * b+1")
    assert parse_expression("a*b") != parse_expression("b*a")
    assert hash(parse_expression("a*b")) == hash(parse_expression(" a * b "))


def test_division_by_zero_is_not_a_python_error():
    assert np.isinf(parse_expression("1 / 0").evaluate({}))


@pytest.mark.parametrize(
    ("text", "token"),
    [
        ("a.b", "'a.b'"),
        ("x[0]", "'x[0]'"),
        ("lambda: 1", "'lambda: 1'"),
        ("'abc'", "\"'abc'\""),
        ("os.system('rm')", "call of 'os.system'"),
        ("__import__('os')", "unknown function '__import__'"),
        ("foo(1)", "unknown function 'foo'"),
        ("a if b else c", "'a if b else c'"),
        ("a < b", "'a < b'"),
        ("a and b", "'a and b'"),
        ("a // b", "'a // b'"),
        ("a % b", "'a % b'"),
        ("True", "'True'"),
        ("1j", "'1j'"),
        ("[a, b]", "'[a, b]'"),
        ("exp(a, b)", "exp() takes 1 argument"),
        ("min(a)", "min() takes at least 2"),
        ("exp(x=1)", "positional arguments only"),
        ("exp", "function 'exp' must be called"),
        ("(a", "syntax error"),
        ("", "empty expression"),
        ("a; b", "syntax error"),
        ("1" * 400, "too large"),
        ("1e999", "not finite"),
        ("-" * 200 + "1", "nested"),
    ],
)
def test_rejects_with_offending_token(text, token):
    with pytest.raises(ModelSpecError, match="derived.x: ") as info:
        parse_expression(text, file="m.toml", location="derived.x")
    assert token in str(info.value)
    assert str(info.value).startswith("m.toml: derived.x: ")


@pytest.mark.parametrize("value", [None, True, [1.0], {"a": 1}, float("nan")])
def test_rejects_non_expressions(value):
    with pytest.raises(ModelSpecError, match="rate"):
        parse_expression(value, location="rate")


# -- property tests -----------------------------------------------------------------
VARS = {"a": 0.7, "b": 1.9, "c": 2.3}


@st.composite
def expressions(draw, depth=0):
    """(text, value) pairs built together, so the expected value never comes from
    parsing the text."""
    if depth > 3 or draw(st.booleans()):
        if draw(st.booleans()):
            name = draw(st.sampled_from(sorted(VARS)))
            return name, VARS[name]
        x = draw(st.floats(0.1, 10.0))
        return repr(x), x
    kind = draw(st.sampled_from(["+", "-", "*", "/", "neg", "exp", "log1p", "sqrt"]))
    ta, va = draw(expressions(depth + 1))
    if kind == "neg":
        return f"-({ta})", -va
    if kind == "exp":
        return f"exp(({ta}) / 100)", math.exp(va / 100)
    if kind in ("log1p", "sqrt"):
        f = {"log1p": math.log1p, "sqrt": math.sqrt}[kind]
        return f"{kind}(abs({ta}))", f(abs(va))
    tb, vb = draw(expressions(depth + 1))
    if kind == "/":
        return f"({ta}) / (1 + abs({tb}))", va / (1 + abs(vb))
    value = {"+": va + vb, "-": va - vb, "*": va * vb}[kind]
    return f"({ta}) {kind} ({tb})", value


@settings(max_examples=50, deadline=None)
@given(expressions())
def test_random_expressions_evaluate_correctly(pair):
    text, value = pair
    got = float(parse_expression(text).evaluate(VARS))
    assert got == pytest.approx(value, rel=1e-12, abs=1e-12)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=40))
def test_arbitrary_text_parses_or_raises_model_spec_error(text):
    try:
        e = parse_expression(text, file="f.toml", location="x")
    except ModelSpecError as err:
        assert str(err).startswith("f.toml: x: ")
    else:
        assert isinstance(e.tree, tuple)


TOKENS = [
    *VARS,
    "1",
    "2.5",
    "+",
    "-",
    "*",
    "/",
    "**",
    "(",
    ")",
    ",",
    "exp",
    "min",
    "log",
    ".",
    "[",
    "]",
    "x",
    "lambda",
    ":",
    "'s'",
    "==",
    "%",
    "if",
    "else",
]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(TOKENS), min_size=1, max_size=12))
def test_token_soup_parses_or_raises_model_spec_error(tokens):
    text = " ".join(tokens)
    try:
        e = parse_expression(text, file="f.toml", location="x")
    except ModelSpecError as err:
        assert str(err).startswith("f.toml: x: ")
    else:
        assert e.names <= set(VARS) | {"x"}
