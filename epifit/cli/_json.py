"""Strict JSON for `--json`: non-finite numbers become `null`, with a note.

`json.dumps` writes `Infinity` and `NaN`, which strict JSON parsers (and
`jq`, JavaScript's `JSON.parse`) reject. `dumps` writes them as `null` and
adds `"non_finite": ["loss", "start_losses[2]", ...]` and a `"note"` naming
them; NumPy scalars and arrays become plain numbers and lists.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np


def dumps(obj: dict[str, Any]) -> str:
    """`obj` as one line of standard JSON (see the module docstring)."""
    found: list[str] = []
    clean = _clean(obj, "", found)
    if found:
        clean["non_finite"] = found
        clean["note"] = (
            f"non-finite numbers written as null: {', '.join(found[:20])}"
            + (f" and {len(found) - 20} more" if len(found) > 20 else "")
        )
    return json.dumps(clean, allow_nan=False)


def _clean(value: Any, where: str, found: list[str]) -> Any:
    if isinstance(value, dict):
        return {
            str(k): _clean(v, f"{where}.{k}" if where else str(k), found)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [_clean(v, f"{where}[{i}]", found) for i, v in enumerate(value)]
    if isinstance(value, np.ndarray):
        return _clean(value.tolist(), where, found)
    if isinstance(value, bool | np.bool_):
        return bool(value)
    if isinstance(value, int | np.integer):
        return int(value)
    if isinstance(value, float | np.floating):
        if not math.isfinite(value):
            found.append(f"{where} ({float(value)})")
            return None
        return float(value)
    if value is None or isinstance(value, str):
        return value
    return str(value)
