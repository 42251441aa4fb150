"""The CLI's programs kept across runs (`epifit._stored`)."""

from __future__ import annotations

import argparse
import contextlib
import os

# flags that decide only where results go and how they are shown
_SHOWN = {"out", "no_progress", "json", "debug"}


def programs_kept(a: argparse.Namespace):
    """Where the compilation cache is on (not `EPIFIT_NO_CACHE`), a context in
    which the command's programs are kept beside it under a key of its
    inputs: a warm run loads them instead of tracing. Every flag but those
    in `_SHOWN` is part of the key.

    A run whose course depends on the clock (`--time-budget`) or on a
    checkpoint (`--resume`) is not a function of its inputs alone (which
    phases it reaches, and so which programs it calls in which order, may
    differ): nothing is kept for it."""
    if os.environ.get("EPIFIT_NO_CACHE") is not None:
        return contextlib.nullcontext()
    if getattr(a, "time_budget", None) is not None or getattr(a, "resume", False):
        return contextlib.nullcontext()
    from epifit._cache import cache_dir
    from epifit._stored import keyed_by_inputs

    settings = {k: v for k, v in sorted(vars(a).items()) if k not in _SHOWN}
    return keyed_by_inputs(settings, cache_dir())
