"""Checks on the files a user names, with errors that name them; atomic writes
and output locks.

Every command that writes a file checks its output with `output_file` before
any work (not an input of the same command, in a writable directory), holds
`output_lock` while it works, and writes with `atomic_write` (a temporary
file beside the target, `fsync`, `os.replace`)."""

from __future__ import annotations

import contextlib
import errno as _errno
import glob
import hashlib
import os
import re
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path


class OutputError(ValueError):
    """An output that would replace one of its command's inputs, or that
    another process is writing."""


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


PathMap = Mapping[str, "str | os.PathLike | None"]


def output_file(
    path: str | os.PathLike,
    *,
    flag: str = "--out",
    inputs: PathMap | None = None,
    also_writes: PathMap | None = None,
) -> Path:
    """`path` as a `Path`, checked before any work to be writable and to be
    none of the command's inputs.

    Two paths are the same file when they resolve to the same path or, for
    files that exist, share device and inode (`os.path.samefile`), so a hard
    link or a symbolic link to an input counts as that input.

    Args:
        path: the output file.
        flag: how the output is named in the errors (`--out`).
        inputs: what the command reads, as `{description: path}`, e.g.
            `{"--data": "x.nc"}`; `None` paths are skipped.
        also_writes: other files the command writes beside `path` (a
            checkpoint), as `{description: path}`; checked against `path` and
            `inputs` too.

    Raises:
        FileNotFoundError: the directory does not exist.
        IsADirectoryError: `path` is a directory.
        PermissionError: no file can be created in the directory.
        OutputError: `path` (or a file of `also_writes`) is one of `inputs`.
    """
    out = Path(path)
    if out.is_dir():
        raise IsADirectoryError(
            f"Cannot write {flag} {out}: it is a directory; give a file name, "
            f"e.g. {out / 'out.nc'}"
        )
    if not out.parent.is_dir():
        raise FileNotFoundError(
            f"Cannot write {out}: directory {out.parent} does not exist."
        )
    if out.exists() and not out.is_file():
        raise OutputError(
            f"Cannot write {flag} {out}: it exists and is not a regular file."
        )
    read = {k: Path(v) for k, v in (inputs or {}).items() if v is not None}
    written = {f"{flag} {out}": out}
    written.update(
        {f"{k} {v}": Path(v) for k, v in (also_writes or {}).items() if v is not None}
    )
    for w_name, w in written.items():
        for r_name, r in read.items():
            if same_file(w, r):
                raise OutputError(
                    f"{w_name} is the same file as {r_name} {r}, which this "
                    "command reads; write the output to another file."
                )
    names = list(written)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            if same_file(written[a], written[b]):
                raise OutputError(
                    f"{a} and {b} are the same file; give {flag} another name "
                    f"(e.g. {out.with_suffix('.nc')})."
                )
    _probe_directory(out, flag)
    return out


def same_file(a: Path, b: Path) -> bool:
    """Whether `a` and `b` name one file: same inode and device, or (for a file
    not written yet) the same resolved path."""
    try:
        if os.path.samefile(a, b):
            return True
    except OSError:
        pass
    return Path(os.path.abspath(a)).resolve() == Path(os.path.abspath(b)).resolve()


def _probe_directory(out: Path, flag: str) -> None:
    """Create and remove a temporary file beside `out`: a read-only directory,
    `/proc` or a full quota fail here, before any work."""
    probe = _temporary(out)
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except OSError as e:
        raise PermissionError(
            f"Cannot write {flag} {out}: cannot create files in directory "
            f"{out.parent} ({describe_os_error(e)})."
        ) from None
    os.close(fd)
    probe.unlink(missing_ok=True)


def describe_os_error(e: OSError) -> str:
    """`no space left on device (ENOSPC)`: the errno's meaning and name, or
    the error's text when it has no errno."""
    if e.errno is None:
        return str(e)
    name = _errno.errorcode.get(e.errno, str(e.errno))
    return f"{os.strerror(e.errno).lower()} ({name})"


# -- atomic writes ------------------------------------------------------------------
def _temporary(path: Path) -> Path:
    """The temporary beside `path`: `.NAME.PID.HEX.tmp`."""
    return path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` exists (on this machine)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    except OSError:
        return False
    return True


def remove_stale_temporaries(path: str | os.PathLike) -> list[Path]:
    """Delete the temporaries `.NAME.PID.HEX.tmp` of `path` left by writers
    that were killed mid-write (their PID is not alive); return them."""
    path = Path(path)
    pattern = re.compile(rf"\.{re.escape(path.name)}\.(\d+)\.[0-9a-f]+\.tmp")
    removed = []
    for name in glob.glob(glob.escape(str(path.parent / f".{path.name}.")) + "*.tmp"):
        match = pattern.fullmatch(Path(name).name)
        if match and not pid_alive(int(match.group(1))):
            with contextlib.suppress(OSError):
                Path(name).unlink()
                removed.append(Path(name))
    return removed


def atomic_write(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Write a file atomically: `write(tmp)` writes a temporary file beside
    `path`, which is flushed to disk and renamed over `path`, so readers see
    the old file or the complete new one, even if the process is killed.

    Stale temporaries of `path` from killed writers are removed first. On any
    failure the temporary is removed and the error raised again.

    Returns:
        `path`, as a `Path`.
    """
    path = Path(path)
    remove_stale_temporaries(path)
    tmp = _temporary(path)
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)
    return path


def _fsync_directory(directory: Path) -> None:
    """Make a rename durable where the platform allows it (POSIX)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_figure(fig, out: str | os.PathLike, *, dpi: int = 110) -> Path:
    """`fig.savefig` to `out` atomically, the format from `out`'s suffix (PNG
    when it has none).

    Raises:
        FileNotFoundError: the directory does not exist.
        ValueError: a suffix matplotlib cannot write.
    """
    out = Path(out)
    if not out.parent.is_dir():
        raise FileNotFoundError(
            f"Cannot write {out}: directory {out.parent} does not exist."
        )
    fmt = out.suffix[1:].lower() or "png"
    supported = fig.canvas.get_supported_filetypes()
    if fmt not in supported:
        raise ValueError(
            f"Cannot write {out}: figures are written as {', '.join(sorted(supported))}"
            f"; got suffix '.{fmt}'."
        )
    return atomic_write(out, lambda tmp: fig.savefig(tmp, dpi=dpi, format=fmt))


# -- output locks -------------------------------------------------------------------
def lock_path(path: str | os.PathLike) -> Path:
    """The lock beside an output: `FIT.nc` -> `FIT.nc.lock`."""
    path = Path(path)
    return path.with_name(path.name + ".lock")


@contextlib.contextmanager
def output_lock(path: str | os.PathLike, *, flag: str = "--out") -> Iterator[Path]:
    """Hold `OUT.lock` (created with `O_EXCL`, holding the PID) while a command
    works towards `path`, so a second command writing the same file fails at
    once instead of silently replacing the first one's output. A lock whose
    PID is not alive (a killed run) is removed.

    Raises:
        OutputError: another live process holds the lock.
    """
    lock = lock_path(path)
    for _ in range(3):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            pid = _lock_pid(lock)
            if pid is None and _age(lock) < 10.0:
                pid = -1  # being written: its PID is not in it yet
            if pid == -1 or (pid is not None and pid_alive(pid)):
                who = f"PID {pid}" if pid > 0 else "starting"
                raise OutputError(
                    f"{flag} {path} is being written by another epifit process "
                    f"({who}, lock {lock}); wait for it to finish or choose "
                    f"another {flag}."
                ) from None
            with contextlib.suppress(FileNotFoundError):
                lock.unlink()  # stale: its writer is gone
            continue
        except OSError as e:
            raise PermissionError(
                f"Cannot write {flag} {path}: cannot create its lock {lock} "
                f"({describe_os_error(e)})."
            ) from None
        with os.fdopen(fd, "w") as fh:
            fh.write(f"{os.getpid()}\n")
        break
    else:  # pragma: no cover - another process keeps recreating it
        raise OutputError(f"Cannot take the lock {lock} of {flag} {path}.")
    try:
        yield lock
    finally:
        if _lock_pid(lock) == os.getpid():
            lock.unlink(missing_ok=True)


def _age(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return float("inf")


def _lock_pid(lock: Path) -> int | None:
    try:
        return int(lock.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def file_sha256(path: str | os.PathLike | None) -> str | None:
    """The SHA-256 hex digest of a file's bytes, or `None` for no file or a
    path that does not exist."""
    if path is None or not Path(path).exists():
        return None
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
