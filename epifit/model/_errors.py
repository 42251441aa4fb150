"""The one error type of the model layer."""

from __future__ import annotations


class ModelSpecError(ValueError):
    """A model specification (TOML file or builder) is invalid.

    The message names the file (when the spec came from one), the location of the
    offending field as a table/field path such as `transitions[2].to`, and what is
    wrong, e.g.
    `models/x.toml: transitions[2].to: unknown compartment 'Q'; known: S, E, I, R`.

    Attributes:
        file: the file (or `"ModelBuilder"`) the spec came from, or `None`.
        location: the table/field path, or `None`.
        reason: the message without file and location.
    """

    def __init__(
        self, reason: str, *, file: str | None = None, location: str | None = None
    ):
        self.file = file
        self.location = location
        self.reason = reason
        parts = [p for p in (file, location) if p]
        super().__init__(": ".join([*parts, reason]))


def describe_type(value: object) -> str:
    """A short description of a value's type for error messages: `int 3`."""
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{type(value).__name__} {text}"
