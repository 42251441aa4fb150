"""The one error type of the model layer."""

from __future__ import annotations

from epifit._errors import LocatedError


class ModelSpecError(LocatedError):
    """A model specification (TOML file or builder) is invalid.

    The message names the file (when the spec came from one), the location of the
    offending field as a table/field path such as `transitions[2].to`, and what is
    wrong, e.g.
    `models/x.toml: transitions[2].to: unknown compartment 'Q'; known: S, E, I, R`.
    """
