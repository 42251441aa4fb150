"""Package attributes imported on first use (PEP 562)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """`(__getattr__, __dir__)` for `package` whose names `exports` (name ->
    defining module) are imported when first read, then kept in the package's
    namespace, so importing the package loads none of them."""

    def __getattr__(name: str):
        if name in exports:
            value = getattr(importlib.import_module(exports[name]), name)
            vars(sys.modules[package])[name] = value
            return value
        raise AttributeError(f"module '{package}' has no attribute '{name}'")

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *exports})

    return __getattr__, __dir__
