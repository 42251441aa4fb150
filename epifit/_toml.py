"""Typed, located access to TOML files and the nested dicts they parse to.

The bottom layer of epifit's file readers: the model files, fit configurations
and scenario files are all read through a `Reader` whose errors name the file
and the field (`models/x.toml: transitions[2].to: ...`).
"""

from __future__ import annotations

import json
import keyword
import math
import re
import tomllib
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar

from epifit._errors import LocatedError, describe_type
from epifit._paths import existing_file
from epifit._stored import note_input

__all__ = ["Reader", "at", "join", "read_values_file"]


def join(items: Iterable[str]) -> str:
    items = list(items)
    return ", ".join(items) if items else "(none)"


def at(location: str | None, key: str | int) -> str:
    if isinstance(key, int):
        return f"{location}[{key}]"
    return key if not location else f"{location}.{key}"


class Reader:
    """Typed access to a raw description (nested dicts from TOML); every failure
    is an `error` naming the file and the field path.

    Subclasses set `error` to their layer's `LocatedError` (`ModelSpecError`,
    `FitConfigError`, `ScenarioError`) and `reserved` to the names an identifier
    may not take.
    """

    error: ClassVar[type[LocatedError]] = LocatedError
    reserved: ClassVar[Collection[str]] = ()

    def __init__(self, file: str | None):
        self.file = file

    def fail(self, location: str | None, reason: str) -> LocatedError:
        return self.error(reason, file=self.file, location=location)

    def toml(self, text: str) -> dict:
        """`text` parsed as TOML; malformed TOML fails at `line N`, and arrays
        or tables nested more than `MAX_NESTING` deep fail naming the file."""
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            match = re.search(r"line (\d+)", str(e))
            # "at end of document": the error is on the last line
            line = match.group(1) if match else max(1, len(text.splitlines()))
            raise self.fail(f"line {line}", f"invalid TOML: {e}") from None
        except (RecursionError, MemoryError):
            raise self.fail(None, _too_deep()) from None
        if (where := _too_deep_at(data)) is not None:
            raise self.fail(where, _too_deep())
        return data

    def toml_file(self, path: Path, kind: str) -> dict:
        """The TOML file `path` parsed (see `toml`); `kind` names what it is in
        the errors for a missing file or a directory, e.g. `"Scenario"`."""
        text = existing_file(path, kind).read_text()
        note_input(path, text.encode())
        return self.toml(text)

    def table(
        self,
        value: Any,
        location: str | None,
        required: tuple[str, ...] = (),
        optional: tuple[str, ...] = (),
    ) -> dict:
        if not isinstance(value, Mapping):
            raise self.fail(location, f"expected a table, got {describe_type(value)}")
        known = required + optional
        for key in value:
            if key not in known:
                raise self.fail(
                    at(location, str(key)),
                    f"unknown field {key!r}; expected one of: {join(known)}",
                )
        for key in required:
            if key not in value:
                raise self.fail(at(location, key), f"missing required field {key!r}")
        return dict(value)

    def array(self, value: Any, location: str, *, nonempty: bool = True) -> list:
        if not isinstance(value, list | tuple):
            raise self.fail(location, f"expected an array, got {describe_type(value)}")
        if nonempty and not value:
            raise self.fail(location, "expected a non-empty array")
        return list(value)

    def string(self, value: Any, location: str) -> str:
        if not isinstance(value, str):
            raise self.fail(location, f"expected a string, got {describe_type(value)}")
        if not value:
            raise self.fail(location, "expected a non-empty string")
        return value

    def choice(self, value: Any, location: str, options: tuple[str, ...]) -> str:
        value = self.string(value, location)
        if value not in options:
            raise self.fail(
                location, f"unknown value {value!r}; expected one of: {join(options)}"
            )
        return value

    def boolean(self, value: Any, location: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(
                location, f"expected true or false, got {describe_type(value)}"
            )
        return value

    def boolean_or(
        self, value: Any, location: str, options: tuple[str, ...]
    ) -> bool | str:
        """`true`, `false` or one of the strings `options`."""
        if isinstance(value, bool) or value in options:
            return value
        expected = join(("true", "false", *(repr(o) for o in options)))
        raise self.fail(
            location, f"expected one of: {expected}; got {describe_type(value)}"
        )

    def integer(self, value: Any, location: str, minimum: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(
                location, f"expected an integer, got {describe_type(value)}"
            )
        if value < minimum:
            raise self.fail(location, f"must be an integer >= {minimum}, got {value}")
        return value

    def number(self, value: Any, location: str, *, finite: bool = True) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(location, f"expected a number, got {describe_type(value)}")
        try:
            number = float(value)
        except OverflowError:
            raise self.fail(location, f"number {value} is too large") from None
        if math.isnan(number) or (finite and not math.isfinite(number)):
            raise self.fail(location, f"expected a finite number, got {value}")
        return number

    def identifier(self, value: Any, location: str, what: str) -> str:
        name = self.string(value, location)
        if not name.isidentifier() or keyword.iskeyword(name):
            raise self.fail(
                location,
                f"{what} name {name!r} is not a valid identifier (letters, digits and "
                "underscores, not starting with a digit, not a Python keyword)",
            )
        if name in self.reserved:
            raise self.fail(
                location, f"{what} name {name!r} would shadow the function {name}()"
            )
        return name


MAX_NESTING = 32  # arrays and tables inside one another; the formats use 4


def _too_deep() -> str:
    return (
        f"invalid TOML: arrays or tables nested more than {MAX_NESTING} deep; "
        "no epifit file needs more than a few levels"
    )


def _too_deep_at(data: Any) -> str | None:
    """The location of the first value nested more than `MAX_NESTING` deep in
    parsed TOML, or `None`; iterative, so it cannot exhaust the stack."""
    stack: list[tuple[Any, str | None, int]] = [(data, None, 0)]
    while stack:
        value, location, depth = stack.pop()
        if depth > MAX_NESTING:
            return location
        if isinstance(value, Mapping):
            items = ((at(location, str(k)), v) for k, v in value.items())
        elif isinstance(value, list):
            items = ((at(location, i), v) for i, v in enumerate(value))
        else:
            continue
        stack.extend((v, loc, depth + 1) for loc, v in items)
    return None


def read_values_file(path: Path, fail: Callable[[str], Exception]) -> dict:
    """Parameter values (`name = value`) from a JSON file (`.json`) or a TOML
    file, at the top level or in a `parameters` table; a file that does not
    parse raises `fail(what the parser said)`."""
    text = existing_file(path, "Parameter").read_text()
    note_input(path, text.encode())
    try:
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except ValueError as e:
        raise fail(str(e)) from e
    except RecursionError:
        raise fail(_too_deep().removeprefix("invalid TOML: ")) from None
    return dict(data.get("parameters", data))
