"""The `epifit` command line: `main(argv) -> exit code`; `run()` is the process.

Each sub-command is a thin handler over the library. Library errors (bad model
files, bad data, solver failures, non-finite numbers, missing or unwritable
files) and bad flags are caught once here and printed as one line
`epifit: error: ...` with exit code 2; with `--json` the same message is also
printed on stdout as `{"error": "..."}`. `--debug` shows the traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from epifit.cli import _commands
from epifit.cli._json import dumps

_EXPECTED = (
    ValueError,  # ModelSpecError, DataError, SizeError, OutputError, ...
    TypeError,
    NotImplementedError,
    RuntimeError,  # SolverError
    OSError,  # FileNotFoundError, PermissionError, IsADirectoryError, ...
    ArithmeticError,  # FloatingPointError, OverflowError, ZeroDivisionError
    MemoryError,
)


class _UsageError(SystemExit):
    """A flag argparse cannot parse: reported by `main` as one line, then
    raised on as argparse would (`SystemExit(2)`)."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not usage + error
        raise _UsageError(f"{message} (see `{self.prog} --help`)")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="epifit",
        description="Fit epidemic compartment models to data, fast (JAX).",
        exit_on_error=False,
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    p.add_argument(
        "--dtype",
        choices=("float64", "float32"),
        default="float64",
        help="floating-point precision (default float64)",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, (help_, add_args, _) in _commands.COMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_, exit_on_error=False)
        add_args(sp)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser()
    wants_json = "--json" in argv
    try:
        args = parser.parse_args(argv)
    except argparse.ArgumentError as e:
        name = e.argument_name or "argument"
        return _fail(f"{name} {e.message}", wants_json)
    except _UsageError as e:
        _fail(e.message, wants_json)
        raise
    if args.command is None:
        parser.print_help()
        return 0
    try:
        _configure(args)
        return _commands.COMMANDS[args.command][2](args)
    except KeyboardInterrupt:
        print("epifit: interrupted", file=sys.stderr)
        return 130
    except _EXPECTED as e:
        if args.debug:
            traceback.print_exc()
        return _fail(_message(e), getattr(args, "json", False))


# The sub-commands that use Dask (its distributed scheduler, `epifit.batch`).
_USES_DASK = frozenset({"batch"})
# What xarray imports when installed, though no array of a run is Dask's
_DASK = ("dask", "distributed")


def run() -> None:
    """The `epifit` process (the console script and `python -m epifit`):
    [`main`][] on `sys.argv`, Dask kept out of the process unless the command
    uses it, then exit with `main`'s code."""
    _without_dask(sys.argv[1:])
    sys.exit(main())


def _without_dask(argv: list[str]) -> None:
    """Where Dask is installed (the `distributed` extra), xarray imports
    `dask.array` whenever it wraps an array and `distributed` whenever it
    writes a file (to ask for a scheduler), for arrays that are all NumPy's:
    0.4-0.7 s of a warm `epifit calibrate` of the demo model (3.3-4.0 s).
    For a command that does not use Dask (no argument names one of
    `_USES_DASK`), its packages are marked absent (`sys.modules[name] =
    None`, which `import` and `importlib.util.find_spec` read as not
    installed) before anything imports them, and xarray takes its path for
    an environment without Dask; the files written are the same. Only at
    the process's start: in a process that goes on (a test, a notebook
    calling `main`), xarray would remember Dask as absent."""
    if _USES_DASK.intersection(argv):
        return
    for name in _DASK:
        sys.modules.setdefault(name, None)


def _message(e: BaseException) -> str:
    """The last line of the error's text (JAX and Equinox put the reason
    last), with the kind of error for the arithmetic ones."""
    text = str(e).strip()
    msg = text.splitlines()[-1] if text else type(e).__name__
    if "SolverError: " in msg:
        msg = msg.split("SolverError: ", 1)[1]
    if isinstance(e, ArithmeticError | MemoryError) and text:
        kind = {
            OverflowError: "overflow",
            ZeroDivisionError: "division by zero",
            FloatingPointError: "non-finite number",
            MemoryError: "out of memory",
        }.get(type(e), type(e).__name__)
        msg = f"{kind}: {msg} (rerun with --debug to see where)"
    elif isinstance(e, MemoryError):
        msg = "out of memory; give fewer days, samples or starts"
    return msg


def _fail(message: str, as_json: bool) -> int:
    print(f"epifit: error: {message}", file=sys.stderr)
    if as_json:
        print(dumps({"error": message}))
    return 2


def _configure(args) -> None:
    import jax

    jax.config.update("jax_enable_x64", args.dtype == "float64")
    if os.environ.get("EPIFIT_NO_CACHE") is None:
        from epifit._cache import enable_compilation_cache

        enable_compilation_cache()
