"""The error of every scenario problem, from parsing to binding."""

from __future__ import annotations

from epifit._errors import LocatedError

__all__ = ["ScenarioError"]


class ScenarioError(LocatedError):
    """An invalid scenario (file, dict or Python object), or one that does not
    fit the model, the data or the horizon.

    `file` is `None` for scenarios built in Python; `location` is a field path
    such as `scenarios.lockdown.changes[0].start`.
    """
