"""Compiled programs kept across processes, for runs whose inputs are files.

A warm `epifit calibrate` (or `forecast`) spends about a second tracing and
lowering its programs again, only to find their executables in JAX's
persistent compilation cache: the cache is keyed by the lowered program, so a
process must trace before it can look. A CLI run is a function of the files
it reads, its flags, its environment and the code, so within
[`keyed_by_inputs`][] a program wrapped by [`stored`][] is exported
(`jax.export`, StableHLO) under a key made of all of those, of its name, of
its place among the run's programs of that name (the order of first calls,
the same in every run with the same inputs) and of its arguments' structure
and shapes, and a later run with the same key loads it instead of tracing.
Any change to an input file, a flag, an environment variable that JAX or
epifit reads, the package versions or epifit's own source makes another key.
Outside the context (the library called from Python, whose functions may
close over anything) nothing is stored, and a program that cannot be exported
(a host callback, an argument that is not an array) is traced as before.

The store is `programs/` in epifit's cache folder (`EPIFIT_CACHE_DIR`),
beside the compilation cache; files are written under a temporary name and
renamed. A file that does not load (truncated, another JAX) is traced again.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import importlib.metadata
import json
import os
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from epifit._paths import file_sha256

if TYPE_CHECKING:  # jax is imported where a program is called, not to read files
    import jax.tree_util as jtu

__all__ = ["keyed_by_inputs", "note_input", "stored"]

_RUN: contextvars.ContextVar[_Run | None] = contextvars.ContextVar(
    "epifit_stored_run", default=None
)
# Python scalars enter a program as weakly typed scalars, and are passed so
_SCALARS = (bool, int, float)
# what the traced programs go through besides epifit's own source
_PACKAGES = ("jax", "jaxlib", "equinox", "optax", "optimistix", "lineax", "numpy")


class _Run:
    """The key material of one run: its settings and the files it read."""

    def __init__(self, settings: Mapping, folder: Path):
        self.settings = dict(settings)
        self.folder = folder
        self.files: dict[str, str] = {}
        # the programs called so far, in order, per name (held, so that no
        # other program takes an address of theirs during the run)
        self.programs: dict[str, list[object]] = {}

    def rank(self, name: str, program: object) -> int:
        """`program`'s place among the run's programs called `name`, in the
        order they were first called. A run is a function of its inputs, so
        the n-th program of a name is the same program in every run with the
        same key; the rank tells apart programs whose names read alike (a
        name holds no object addresses: see `_key`)."""
        seen = self.programs.setdefault(name, [])
        for i, p in enumerate(seen):
            if p is program:
                return i
        seen.append(program)
        return len(seen) - 1

    def digest(self) -> str:
        material = {
            "settings": self.settings,
            "files": sorted(self.files.items()),
            "environment": _environment(),
        }
        text = json.dumps(material, sort_keys=True, default=repr)
        return hashlib.sha256(text.encode()).hexdigest()


@contextlib.contextmanager
def keyed_by_inputs(settings: Mapping, folder: str | os.PathLike) -> Iterator[None]:
    """Within this context, programs wrapped by [`stored`][] are kept in
    `folder/programs` under a key of `settings` (the command and its flags,
    JSON-able), the contents of every file read through [`note_input`][],
    the environment and the code, and loaded from there when the key
    matches. For the CLI only: its runs are functions of those inputs."""
    token = _RUN.set(_Run(settings, Path(folder) / "programs"))
    try:
        yield
    finally:
        _RUN.reset(token)


def note_input(path: str | os.PathLike, content: bytes | None = None) -> None:
    """Record that the run read `path` (its `content`, else the file's): the
    stored programs' key covers it. Nothing outside [`keyed_by_inputs`][]."""
    run = _RUN.get()
    if run is None:
        return
    if content is None:
        digest = file_sha256(path)
    else:
        digest = hashlib.sha256(content).hexdigest()
    run.files[str(Path(path).resolve())] = digest


def stored(
    name: str,
    fun: Callable,
    *,
    out_tree: Callable[..., jtu.PyTreeDef] | None,
    once: bool = False,
) -> Callable:
    """`epifit.jit(fun, once=once)`, kept across processes within
    [`keyed_by_inputs`][] and called as itself outside it (its other
    attributes, `lower` and so on, are the jitted function's).

    `name` tells the program apart from the run's others (with its place
    in the order of first calls among the programs of that name, and its
    arguments' structure and shapes). `out_tree(*args)` is the structure of
    its output (the stored program returns the leaves); with None the
    structure is stored with the program, which needs it to be made of
    dicts, lists, tuples and None (else the program is not stored)."""
    import jax
    import jax.tree_util as jtu
    import numpy as np

    from epifit._jit import compiler_options, jit, once_options

    leaf_types = (jax.Array, np.ndarray, np.generic, *_SCALARS)

    jitted = jit(fun, once=once)
    options = once_options() if once else compiler_options()
    loaded: dict[str, Callable | None] = {}

    def program_for(args):
        """`(program, leaves)` of the stored program for `args` (its inputs
        committed to the device: `jit(exported.call)` lowers differently for
        uncommitted ones, the first chunk's, and would compile twice), or
        None where there is none: outside the context, or not exportable."""
        run = _RUN.get()
        if run is None:
            return None
        leaves, tree = jtu.tree_flatten(args)
        if not all(isinstance(x, leaf_types) for x in leaves):
            return None
        key = _key(run, name, run.rank(_plain(name), call), tree, leaves)
        if key not in loaded:
            loaded[key] = _load_or_export(
                run.folder, key, fun, tree, leaves, options, out_tree is None
            )
        if loaded[key] is None:
            return None
        return loaded[key], on_device(leaves)

    def on_device(leaves):
        device = jax.devices()[0]
        return [
            x if isinstance(x, _SCALARS) else jax.device_put(x, device) for x in leaves
        ]

    def output(args, out):
        return out if out_tree is None else jtu.tree_unflatten(out_tree(*args), out)

    def call(*args):
        found = program_for(args)
        if found is None:
            return jitted(*args)
        program, leaves = found
        return output(args, program(*leaves))

    def compiled(*args):
        found = program_for(args)
        if found is None:
            return jitted.lower(*args).compile()
        program, leaves = found
        executable = program.lower(*leaves).compile()

        def run(*args):
            return output(args, executable(*on_device(jtu.tree_leaves(args))))

        return run

    return _Stored(call, compiled, jitted)


class _Stored:
    """A stored program: called through the store, and otherwise the jitted
    function (`lower`, `trace`, its cache...)."""

    def __init__(self, call: Callable, compiled: Callable, jitted: Callable):
        self._call = call
        self._compiled = compiled
        self._jitted = jitted

    def __call__(self, *args):
        return self._call(*args)

    def compiled(self, *args) -> Callable:
        """The program compiled ahead of time for arguments like `args`
        (`jitted.lower(*args).compile()` outside the store's context): to
        call from several threads without each compiling it."""
        return self._compiled(*args)

    def __getattr__(self, name: str):
        return getattr(self._jitted, name)


def _plain(text: str) -> str:
    """`text` without the object addresses a repr holds (they change from
    process to process)."""
    return re.sub(r"0x[0-9a-f]+", "", text)


def _key(run: _Run, name: str, rank: int, tree, leaves) -> str:
    import numpy as np

    shapes = [
        (np.shape(x), str(getattr(x, "dtype", type(x).__name__)), _weak(x))
        for x in leaves
    ]
    text = json.dumps([run.digest(), _plain(name), rank, _plain(str(tree)), shapes])
    return hashlib.sha256(text.encode()).hexdigest()


def _weak(x) -> bool:
    """Whether `x` enters a traced program weakly typed (a Python scalar)."""
    return isinstance(x, _SCALARS) or bool(getattr(x, "weak_type", False))


def _load_or_export(folder: Path, key: str, fun, tree, leaves, options, structured):
    """The stored program of `key`, exported (and written) if not there yet;
    None where it cannot be exported."""
    import jax
    import jax.tree_util as jtu
    from jax import export

    path = folder / f"{key}.jaxexport"
    exported = None
    if path.is_file():
        try:
            exported = export.deserialize(bytearray(path.read_bytes()))
        except Exception:  # an unreadable file: export again
            exported = None
    if exported is None:

        def flat(*xs):
            out = fun(*jtu.tree_unflatten(tree, xs))
            return out if structured else jtu.tree_leaves(out)

        try:
            exported = export.export(jax.jit(flat))(*leaves)
            blob = exported.serialize()
        except Exception:  # a host callback, a custom call JAX cannot export...
            return None
        _write(path, bytes(blob))
    return jax.jit(exported.call, compiler_options=options or None)


def _write(path: Path, blob: bytes) -> None:
    """`blob` to `path`, under a temporary name renamed into place; a store
    that cannot be written is skipped (the run goes on)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(blob)
        os.replace(tmp, path)
    except OSError:  # a full disk, a read-only folder: nothing half-written
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def _environment() -> dict:
    """What besides the inputs decides a traced program: the code, the
    packages it goes through, JAX's configuration and devices."""
    import jax

    env = {
        k: v
        for k, v in os.environ.items()
        if k.startswith(("JAX_", "XLA_", "EPIFIT_")) and k != "EPIFIT_CACHE_DIR"
    }
    return {
        "code": _code_digest(),
        "packages": _versions(),
        "x64": bool(jax.config.jax_enable_x64),
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "cpus": os.cpu_count(),
        "variables": env,
    }


@functools.cache
def _code_digest() -> str:
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for p in sorted(root.rglob("*.py")):
        h.update(str(p.relative_to(root)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()


@functools.cache
def _versions() -> dict:
    out = {}
    for name in _PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out
