"""Checks on the files a user names, with errors that name them."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def existing_file(path: str | os.PathLike, what: str) -> Path:
    """`path` as a `Path`, checked to be an existing file; `what` names the file
    in the errors, e.g. `"Scenario"`: `Scenario file x.toml does not exist.`

    Raises:
        FileNotFoundError: no such file.
        IsADirectoryError: `path` is a directory.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{what} file {p} does not exist.")
    if p.is_dir():
        raise IsADirectoryError(f"{what} path {p} is a directory, not a file.")
    return p


def output_file(path: str | os.PathLike) -> Path:
    """`path` as a `Path`, checked to be in an existing directory.

    Raises:
        FileNotFoundError: the directory does not exist.
    """
    out = Path(path)
    if not out.parent.is_dir():
        raise FileNotFoundError(
            f"Cannot write {out}: directory {out.parent} does not exist."
        )
    return out


def file_sha256(path: str | os.PathLike | None) -> str | None:
    """The SHA-256 hex digest of a file's bytes, or `None` for no file or a
    path that does not exist."""
    if path is None or not Path(path).exists():
        return None
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
