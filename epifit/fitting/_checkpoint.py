"""Atomic checkpoints of a running fit, and resuming from them.

A checkpoint holds the optimiser's full state between two chunks (every leaf of
every start's carry, as exact binary arrays), the run's record (histories,
phase, iteration counts) and a fingerprint of the fit (model, data, starting
points, configuration). It is written to a temporary file in the target's
directory, flushed to disk (`fsync`) and renamed over the checkpoint
(`os.replace`): a process killed at any moment, even by SIGKILL in the middle
of a write, leaves either the previous checkpoint or the new one, never a torn
file. Resuming restores the state bit for bit, so the resumed fit reproduces
the uninterrupted one exactly.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from epifit._errors import LocatedError
from epifit._paths import atomic_write

__all__ = [
    "CheckpointError",
    "checkpoint_path",
    "fingerprint",
    "load_checkpoint",
    "save_checkpoint",
]

FORMAT = 2  # 2: a carry holds the method state of every phase of its program
# Test hook: called as `_hook(tmp_path)` after the first half of a checkpoint
# has been written to its temporary file (the SIGKILL-mid-write test uses it).
_hook: Callable[[Path], None] | None = None


class CheckpointError(LocatedError):
    """A checkpoint that cannot be used for this fit."""


def checkpoint_path(out: str | os.PathLike) -> Path:
    """The checkpoint beside an output file: `FIT.nc` -> `FIT.ckpt`."""
    return Path(out).with_suffix(".ckpt")


def _canonical(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {
            "__type__": type(obj).__name__,
            **{
                f.name: _canonical(getattr(obj, f.name))
                for f in dataclasses.fields(obj)
                if f.compare
            },
        }
    if isinstance(obj, frozenset | set):
        return sorted(_canonical(x) for x in obj)
    if isinstance(obj, dict):
        return {str(k): _canonical(v) for k, v in sorted(obj.items(), key=str)}
    if isinstance(obj, list | tuple):
        return [_canonical(x) for x in obj]
    if isinstance(obj, float | int | str | bool) or obj is None:
        return obj
    return repr(obj)


def fingerprint(*, spec, arrays, xs, settings: dict) -> str:
    """A hash of everything that determines a fit's numbers."""
    h = hashlib.sha256()
    h.update(json.dumps(_canonical(spec), sort_keys=True, default=str).encode())
    for path, leaf in jax.tree_util.tree_flatten_with_path(arrays)[0]:
        a = np.ascontiguousarray(np.asarray(leaf))
        h.update(jax.tree_util.keystr(path).encode())
        h.update(str((a.dtype, a.shape)).encode())
        h.update(a.tobytes())
    x = np.ascontiguousarray(np.asarray(xs))
    h.update(str((x.dtype, x.shape)).encode() + x.tobytes())
    h.update(json.dumps(_canonical(settings), sort_keys=True, default=str).encode())
    return h.hexdigest()


def save_checkpoint(path: str | os.PathLike, carry, record: dict, key: str) -> Path:
    """Write a checkpoint atomically (temporary file, fsync, rename)."""
    path = Path(path)
    arrays: dict[str, np.ndarray] = {}
    leaves = jax.tree.leaves(carry)
    for i, leaf in enumerate(leaves):
        arrays[f"leaf_{i}"] = np.asarray(leaf)
    hist = record["history"]
    n_starts = len(hist["loss"])
    for k, per_start in hist.items():
        for s, a in enumerate(per_start):
            arrays[f"hist_{k}_{s}"] = np.asarray(a, np.float64)
    arrays["initial_loss"] = np.asarray(record["initial_loss"], np.float64)
    meta = {
        "format": FORMAT,
        "fingerprint": key,
        "n_leaves": len(leaves),
        "n_starts": n_starts,
        "history_keys": list(hist),
        "phase": int(record["phase"]),
        "phase_iteration": int(record["phase_iteration"]),
        "iteration": int(record["iteration"]),
        "elapsed": float(record["elapsed"]),
        "statuses": record["statuses"],
    }
    arrays["meta"] = np.asarray(json.dumps(meta))
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    payload = buffer.getvalue()

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as fh:
            half = len(payload) // 2
            fh.write(payload[:half])
            if _hook is not None:
                fh.flush()
                _hook(tmp)
            fh.write(payload[half:])

    return atomic_write(path, write)


def load_checkpoint(path: str | os.PathLike, template, key: str) -> dict:
    """Read a checkpoint into the structure of `template` (a carry of
    `ShapeDtypeStruct`s); checks that it belongs to this fit."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            data = {k: z[k] for k in z.files}
        meta = json.loads(str(data["meta"]))
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
        raise CheckpointError(
            f"Cannot read checkpoint {path}: {e}. Delete it to start afresh."
        ) from e
    _check_meta(path, meta, data)
    if meta["fingerprint"] != key:
        raise CheckpointError(
            f"Checkpoint {path} belongs to a different fit (the model, data, "
            "starting points or optimiser settings differ). Delete it, or run "
            "without resume to start afresh."
        )
    t_leaves, treedef = jax.tree.flatten(template)
    if meta["n_leaves"] != len(t_leaves):
        raise CheckpointError(
            f"Checkpoint {path} holds {meta['n_leaves']} state arrays; this fit's "
            f"phase {meta['phase'] + 1} has {len(t_leaves)}. Delete it to start afresh."
        )
    leaves = []
    for i, t in enumerate(t_leaves):
        a = data[f"leaf_{i}"]
        if a.shape != tuple(t.shape) or a.dtype != t.dtype:
            raise CheckpointError(
                f"Checkpoint {path}: state array {i} has {a.dtype}{list(a.shape)}; "
                f"expected {t.dtype}{list(t.shape)}. Delete it to start afresh."
            )
        leaves.append(jax.device_put(a))  # (jnp.asarray compiles per shape)
    carry = jax.tree.unflatten(treedef, leaves)
    n = meta["n_starts"]
    record = {
        "phase": meta["phase"],
        "phase_iteration": meta["phase_iteration"],
        "iteration": meta["iteration"],
        "elapsed": meta["elapsed"],
        "statuses": meta["statuses"],
        "initial_loss": data["initial_loss"],
        "history": {
            k: [data[f"hist_{k}_{s}"] for s in range(n)] for k in meta["history_keys"]
        },
    }
    return {"carry": carry, "record": record}


def checkpoint_phase(path: str | os.PathLike) -> int:
    """The phase a checkpoint was written in (to build its template)."""
    try:
        with np.load(Path(path), allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
        raise CheckpointError(
            f"Cannot read checkpoint {path}: {e}. Delete it to start afresh."
        ) from e
    if not isinstance(meta, dict):
        raise _damaged(path, "its metadata is not a table")
    return _count(path, meta, "phase")


_META = (
    "format",
    "fingerprint",
    "n_leaves",
    "n_starts",
    "history_keys",
    "phase",
    "phase_iteration",
    "iteration",
    "elapsed",
    "statuses",
)


def _damaged(path, why: str) -> CheckpointError:
    return CheckpointError(
        f"Checkpoint {path} is damaged: {why}. Delete it to start afresh."
    )


def _count(path, meta: dict, key: str, minimum: int = 0) -> int:
    """A non-negative integer field of a checkpoint's metadata."""
    v = meta.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise _damaged(path, f"'{key}' must be an integer >= {minimum}, got {v!r}")
    return v


def _check_meta(path, meta: Any, data: dict) -> None:
    """Every field of a checkpoint's metadata present, of its type and
    consistent with the arrays stored beside it."""
    if not isinstance(meta, dict):
        raise _damaged(path, "its metadata is not a table")
    if meta.get("format") != FORMAT:
        raise CheckpointError(
            f"Checkpoint {path} has format {meta.get('format')}; this epifit writes "
            f"format {FORMAT}. Delete it to start afresh."
        )
    missing = [k for k in _META if k not in meta]
    if missing:
        raise _damaged(path, f"its metadata lacks {', '.join(missing)}")
    if not isinstance(meta["fingerprint"], str):
        raise _damaged(path, "'fingerprint' is not a string")
    for k in ("n_leaves", "n_starts", "phase", "phase_iteration", "iteration"):
        _count(path, meta, k, 1 if k == "n_starts" else 0)
    if meta["phase_iteration"] > meta["iteration"]:
        raise _damaged(
            path,
            f"'phase_iteration' ({meta['phase_iteration']}) exceeds 'iteration' "
            f"({meta['iteration']})",
        )
    elapsed = meta["elapsed"]
    if (
        isinstance(elapsed, bool)
        or not isinstance(elapsed, int | float)
        or not elapsed >= 0
    ):
        raise _damaged(path, f"'elapsed' must be a number >= 0, got {elapsed!r}")
    n = meta["n_starts"]
    statuses = meta["statuses"]
    if not isinstance(statuses, list) or any(
        not isinstance(s, list) or len(s) != n for s in statuses
    ):
        raise _damaged(path, f"'statuses' must be lists of {n} status codes")
    keys = meta["history_keys"]
    if not isinstance(keys, list) or "loss" not in keys:
        raise _damaged(path, "'history_keys' must list the histories, 'loss' first")
    names = [f"leaf_{i}" for i in range(meta["n_leaves"])] + ["initial_loss"]
    names += [f"hist_{k}_{s}" for k in keys for s in range(n)]
    absent = [k for k in names if k not in data]
    if absent:
        raise _damaged(path, f"it lacks the arrays {', '.join(absent[:5])}")
    if np.shape(data["initial_loss"]) != (n,):
        raise _damaged(path, f"'initial_loss' is not one loss per start ({n})")
    for k in keys:
        for s in range(n):
            a = data[f"hist_{k}_{s}"]
            if a.ndim != 1 or a.size > meta["iteration"]:
                raise _damaged(
                    path,
                    f"history '{k}' of start {s} holds {a.size} entries for "
                    f"{meta['iteration']} iterations",
                )
