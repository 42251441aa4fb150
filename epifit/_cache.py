"""JAX's persistent compilation cache in a user cache directory."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$EPIFIT_CACHE_DIR`, else `$XDG_CACHE_HOME/epifit/jax`, else `~/.cache/...`."""
    if d := os.environ.get("EPIFIT_CACHE_DIR"):
        return Path(d)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "epifit" / "jax"


def enable_compilation_cache(path: str | os.PathLike | None = None) -> Path:
    """Persist compiled executables across runs (a second run does not compile).

    Every executable that took longer than 0.5 s to compile is cached.
    """
    import jax

    d = Path(path) if path is not None else cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(d))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return d
