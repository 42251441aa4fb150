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
    # Interpolated saves (`make_grid(..., inner=K)`): `(n_seg, K)` save times
    # inside each segment, increasing, padded with +inf; `None` where every
    # save time is a segment boundary. `save_index` then indexes the states
    # at `bounds` followed by these, row-major.
    inner: np.ndarray | None = None

    @property
    def n_inner(self) -> int:
        """The inner (interpolated) save slots of a segment (0 if none)."""
        return 0 if self.inner is None else self.inner.shape[1]


def make_grid(
    ts: np.ndarray,
    input_times: np.ndarray | None,
    dt0_fixed: float | None,
    inner: int = 0,
):
    """The [`Grid`][] of save times `ts`, input break times `input_times` and
    fixed step `dt0_fixed` (`None` for adaptive steps). `O(n log n)` NumPy work
    in the number of times; nothing is traced.

    With `inner = K > 0`, a save time that is not an input break time is a
    segment boundary only where `K` save times already lie inside the
    segment; the others are *inner* saves (`Grid.inner`), interpolated by the
    solver's dense output, so that no step is clipped at them. `K` bounds
    the length of a segment, whose steps the checkpoint adjoint replays."""
    ts = np.asarray(ts, dtype=np.float64)
    t0, t1 = ts[0], ts[-1]
    scale = max(1.0, abs(t0), abs(t1))
    hard = [ts[[0, -1]]]
    if input_times is not None:
        it = np.asarray(input_times, dtype=np.float64)
        hard.append(it[(it > t0) & (it < t1)])
    hard = _merged(np.concatenate(hard), scale)
    allpts = _merged(np.concatenate([hard, ts]), scale)
    if inner > 0:
        bounds, inner_t = _split_inner(allpts, hard, inner, scale)
    else:
        bounds, inner_t = allpts, None
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
    save_index = _save_index(ts, bounds, inner_t, scale)
    if dt0_fixed is None:
        n_fixed = np.ones(bounds.size - 1, dtype=np.int32)
    else:
        n_fixed = np.maximum(
            1, np.ceil(np.diff(bounds) / dt0_fixed - 1e-9).astype(np.int32)
        )
    return Grid(bounds, input_index, save_index, n_fixed, inner_t)


def _merged(points, scale):
    """The sorted unique `points`, those closer than rounding merged (e.g.
    `0.5 - 1e-17` and `0.5`)."""
    pts = np.unique(points)
    keep = np.concatenate([[True], np.diff(pts) > 1e-12 * scale])
    return pts[keep]


def _is_in(x, ref, scale):
    """Whether each of `x` is one of the sorted `ref`, to rounding."""
    j = np.clip(np.searchsorted(ref, x), 1, ref.size - 1)
    near = np.minimum(np.abs(ref[j] - x), np.abs(ref[j - 1] - x))
    return near <= 1e-12 * scale


def _split_inner(allpts, hard, k_max, scale):
    """`(bounds, inner)`: the points of `allpts` that are `hard` (the ends and
    the input break times) or that follow `k_max` inner saves in their
    segment are boundaries; the others are inner saves, `(n_seg, k_max)`
    padded with +inf."""
    is_hard = _is_in(allpts, hard, scale)
    bounds, inner, count = [allpts[0]], [[]], 0
    for p, h in zip(allpts[1:], is_hard[1:], strict=True):
        if h or count == k_max:
            bounds.append(p)
            inner.append([])
            count = 0
        else:
            inner[-1].append(p)
            count += 1
    inner = inner[:-1]  # the last boundary starts no segment
    table = np.full((len(inner), k_max), np.inf)
    for row, saves in zip(table, inner, strict=True):
        row[: len(saves)] = saves
    return np.asarray(bounds), table


def _save_index(ts, bounds, inner, scale):
    """Each save time's row in the solve's states: `bounds` first, then (with
    inner saves) `inner`, row-major."""
    idx = np.searchsorted(bounds, ts - 1e-12 * scale, side="left").astype(np.int32)
    if inner is None:
        return idx
    seg = np.searchsorted(bounds, ts, side="right") - 1
    for i in np.flatnonzero(~_is_in(ts, bounds, scale)):
        j = int(np.argmin(np.abs(inner[seg[i]] - ts[i])))
        idx[i] = bounds.size + seg[i] * inner.shape[1] + j
    return idx
