"""`vmap` over a leading batch axis, in groups, without batching a batch of one."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp


def vmap_batch(
    fn: Callable,
    in_axes: int | Sequence[int | None] = 0,
    *,
    group: int | None = None,
) -> Callable:
    """`jax.vmap(fn, in_axes)` over a leading batch axis (a fit's starting
    points, a forecast's parameter samples), or a loop over it.

    Batching turns every `lax.cond` whose predicate depends on the batched
    values into a select that evaluates both branches, and every such while
    loop (the solver's step loops, the line search's) into a masked one that
    selects its whole carry at each iteration and runs until its slowest
    member is done. That pays while a member's work per operation is small;
    for a solve of a few thousand state elements on CPU it costs more than it
    saves (measurements in `epifit/README.md`).

    Args:
        fn: the function of one member.
        in_axes: `0`, or one `0`/`None` per positional argument (`None`: the
            same for every member).
        group: members batched together. `None` batches the whole batch;
            `g` runs groups of `g` members one after another in a `lax.map`
            (a compiled loop), each group batched; `1` applies `fn` to one
            member at a time, unbatched. A batch of one is always applied to
            its member, unbatched.

    The batch size is a shape, so the choice is made at trace time and a
    compiled function is the same computation at every call (checkpointed
    fits still resume exactly). Results are those of `jax.vmap(fn, in_axes)`.
    """
    if group is not None and (isinstance(group, bool) or int(group) < 1):
        raise ValueError(f"group must be a positive int or None; got {group!r}")
    batched = jax.vmap(fn, in_axes=in_axes)

    def call(*args):
        axes = (in_axes,) * len(args) if isinstance(in_axes, int) else tuple(in_axes)
        if len(axes) != len(args):
            raise TypeError(f"in_axes {in_axes!r} does not match {len(args)} arguments")
        sizes = {
            leaf.shape[0]
            for a, ax in zip(args, axes, strict=True)
            if ax is not None
            for leaf in jax.tree.leaves(a)
        }
        if not sizes:
            raise ValueError("vmap_batch: no argument has a batch axis")
        if len(sizes) != 1:
            raise ValueError(f"batched arguments disagree on the batch size: {sizes}")
        (size,) = sizes
        g = size if group is None else min(int(group), size)
        if size > 1 and g == size:
            return batched(*args)
        if size == 1:
            one = [
                a if ax is None else jax.tree.map(lambda x: x[0], a)
                for a, ax in zip(args, axes, strict=True)
            ]
            return jax.tree.map(lambda y: jnp.asarray(y)[None], fn(*one))
        mapped = tuple(a for a, ax in zip(args, axes, strict=True) if ax is not None)

        def member(xs):
            it = iter(xs)
            full = [
                a if ax is None else next(it) for a, ax in zip(args, axes, strict=True)
            ]
            return fn(*full)

        return jax.lax.map(member, mapped, batch_size=None if g == 1 else g)

    return call


def default_group(backend: str | None = None) -> int | None:
    """The `group` of [`vmap_batch`][] for a fit's starting points.

    On CPU, `1`: starts run one after another, each unbatched, which is
    faster and compiles a smaller program than batching them for every model
    measured (`epifit/README.md`). Elsewhere (GPU, TPU) `None`: all starts
    batched, which is what an accelerator is for.
    """
    return 1 if (backend or jax.default_backend()) == "cpu" else None
