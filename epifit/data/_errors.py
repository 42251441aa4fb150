"""The one exception class of the data layer."""

from __future__ import annotations

from epifit._errors import LocatedError


class DataError(LocatedError):
    """A dataset, data file or table does not meet epifit's conventions.

    The message names the file or variable, says what is wrong and lists what was
    available, e.g. `No variable 'cases' in dataset; found ['deaths', 'in_bed']`.
    """
