"""The located-error base: errors in a file, dataset or configuration that say
where (file and field path) and what is wrong."""

from __future__ import annotations

__all__ = ["LocatedError", "describe_type"]


class LocatedError(ValueError):
    """An invalid input that can be pinned to a place: a file and a field path.

    The message is `file: location: reason` with the parts that are known, e.g.
    `models/x.toml: transitions[2].to: unknown compartment 'Q'; known: S, E, I, R`.
    Each layer's error (`ModelSpecError`, `DataError`, `FitConfigError`,
    `ScenarioError`, `CheckpointError`) subclasses it, so the CLI reports them
    all the same way. It subclasses `ValueError`, so code that catches
    `ValueError` keeps working.

    Attributes:
        file: the file (or `"ModelBuilder"`) the input came from, or `None`.
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
    try:
        text = repr(value)
    except RecursionError:  # a value nested too deeply to print
        text = "(nested too deeply to show)"
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{type(value).__name__} {text}"
