"""The `epifit` command line: `main(argv) -> exit code`.

Each sub-command is a thin handler over the library. Library errors (bad model
files, bad data, solver failures, missing files) are caught once here and
printed as `epifit: error: ...` with exit code 2; `--debug` shows the
traceback instead.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from epifit.cli import _commands

_EXPECTED = (
    ValueError,  # ModelSpecError, DataError and argument errors subclass it
    TypeError,
    FileNotFoundError,
    PermissionError,
    IsADirectoryError,
    NotImplementedError,
    RuntimeError,  # SolverError
    OSError,
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="epifit",
        description="Fit epidemic compartment models to data, fast (JAX).",
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    p.add_argument(
        "--dtype",
        choices=("float64", "float32"),
        default="float64",
        help="floating-point precision (default float64)",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_, add_args, _) in _commands.COMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_)
        add_args(sp)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
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
        msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        if "SolverError" in str(e) and "SolverError: " in msg:
            msg = msg.split("SolverError: ", 1)[1]
        print(f"epifit: error: {msg}", file=sys.stderr)
        return 2


def _configure(args) -> None:
    import jax

    jax.config.update("jax_enable_x64", args.dtype == "float64")
    if os.environ.get("EPIFIT_NO_CACHE") is None:
        from epifit._cache import enable_compilation_cache

        enable_compilation_cache()
