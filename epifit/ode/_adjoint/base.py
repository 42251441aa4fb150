"""Adjoint interface: how a solve is differentiated."""

from __future__ import annotations

import abc

import equinox as eqx


class AbstractAdjoint(eqx.Module):
    """Decides how reverse-mode derivatives of a solve are computed.

    `loop(integrator, grid, y0, args, values, dt0)` integrates over every segment
    and returns `(ys, stats, fail)`, with `ys` the states at all segment
    boundaries; its custom VJP defines the gradient. Only `y0`, `args` and the
    input `values` are differentiated; a cotangent is formed for an input leaf
    only when the caller differentiates with respect to it.

    `backward_can_fail`: whether a reverse adjoint's `segment_backward` also
    returns `(code, t)`, the outcome of its backward integration (see
    `_common._reverse_scan`); a replay of the forward steps cannot fail.

    `differentiates_inner_saves`: whether it differentiates a solve whose
    save times are interpolated inside the steps (`solve(...,
    interpolate_saves=True)`; the grid's inner saves, `ys` then holds the
    states there after those at the boundaries).
    """

    backward_can_fail = False
    differentiates_inner_saves = False

    @abc.abstractmethod
    def loop(self, integrator, grid, y0, args, values, dt0): ...
