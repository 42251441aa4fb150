"""Size checks against the machine's memory, before anything is allocated."""

from __future__ import annotations

import os

__all__ = ["SizeError", "check_memory", "format_bytes", "memory_limit"]

# when the machine's memory cannot be read
FALLBACK_BYTES = 8 * 2**30
# the share of physical memory one command may plan to hold: the rest is the
# program, the compiled solver, copies made by NumPy and netCDF, other programs
SHARE = 0.5


class SizeError(ValueError):
    """A request (a horizon, a number of starts or samples) whose arrays would
    not fit in this machine's memory."""


def memory_limit() -> int:
    """Bytes one command may plan to allocate: half the physical memory
    (`os.sysconf`), or `EPIFIT_MEMORY_LIMIT` (bytes) when set; 8 GiB when
    neither can be read."""
    env = os.environ.get("EPIFIT_MEMORY_LIMIT")
    if env:
        try:
            return int(float(env))
        except ValueError:
            pass
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return FALLBACK_BYTES
    return int(total * SHARE) if total > 0 else FALLBACK_BYTES


def format_bytes(n: float) -> str:
    """`45 GB`, `3.2 MB`: decimal units, two significant digits or more."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            value = n / size
            return f"{value:.0f} {unit}" if value >= 10 else f"{value:.1f} {unit}"
    return f"{n:.0f} bytes"


def check_memory(nbytes: float, what: str, breakdown: str, fix: str) -> None:
    """Raise `SizeError` if `nbytes` exceeds `memory_limit()`.

    The message reads `{what} needs about 45 GB for {breakdown}; at most 12 GB
    on this machine; {fix}`, e.g. `days = 100000000 needs about 45 GB for the
    trajectories (16 states x 20 patches x 1e8 days x 8 bytes); ...`.
    """
    limit = memory_limit()
    if nbytes > limit:
        raise SizeError(
            f"{what} needs about {format_bytes(nbytes)} for {breakdown}; at most "
            f"{format_bytes(limit)} on this machine (half its memory; set "
            f"EPIFIT_MEMORY_LIMIT in bytes to change it); {fix}."
        )
