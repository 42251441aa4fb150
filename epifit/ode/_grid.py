"""The segment grid of a solve, built in NumPy at trace time.

A solve runs over *segments*: the intervals between consecutive points of the
union of the save times and the input break times. Inside a segment the inputs
are constant, so the vector field is smooth there.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Grid(NamedTuple):
    """Concrete (NumPy) description of the segments of a solve."""

    bounds: np.ndarray  # (n_seg + 1,) segment boundaries
    input_index: np.ndarray  # (n_seg,) which input value holds on each segment
    save_index: np.ndarray  # (n_save,) index into bounds of each save time
    n_fixed: np.ndarray  # (n_seg,) steps per segment for ConstantStepSize (else 1)


def make_grid(ts: np.ndarray, input_times: np.ndarray | None, dt0_fixed: float | None):
    """The [`Grid`][] of save times `ts`, input break times `input_times` and
    fixed step `dt0_fixed` (`None` for adaptive steps). `O(n log n)` NumPy work
    in the number of times; nothing is traced."""
    ts = np.asarray(ts, dtype=np.float64)
    t0, t1 = ts[0], ts[-1]
    pts = [ts]
    if input_times is not None:
        it = np.asarray(input_times, dtype=np.float64)
        pts.append(it[(it > t0) & (it < t1)])
    allpts = np.unique(np.concatenate(pts))
    # Merge boundaries closer than rounding (e.g. 0.5 - 1e-17 and 0.5).
    scale = max(1.0, abs(t0), abs(t1))
    keep = np.concatenate([[True], np.diff(allpts) > 1e-12 * scale])
    bounds = allpts[keep]
    if bounds.size < 2:
        raise ValueError(
            f"solve needs ts spanning an interval; got ts from {t0} to {t1}."
        )
    if input_times is None:
        input_index = np.zeros(bounds.size - 1, dtype=np.int32)
    else:
        it = np.asarray(input_times, dtype=np.float64)
        k = np.searchsorted(it, bounds[:-1] + 1e-12 * scale, side="right") - 1
        input_index = np.clip(k, 0, it.size - 1).astype(np.int32)
    save_index = np.searchsorted(bounds, ts - 1e-12 * scale, side="left").astype(
        np.int32
    )
    if dt0_fixed is None:
        n_fixed = np.ones(bounds.size - 1, dtype=np.int32)
    else:
        n_fixed = np.maximum(
            1, np.ceil(np.diff(bounds) / dt0_fixed - 1e-9).astype(np.int32)
        )
    return Grid(bounds, input_index, save_index, n_fixed)
