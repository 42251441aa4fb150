"""`epifit.jit`: `jax.jit` with compiler options suited to ODE solves on CPU."""

from __future__ import annotations

import functools

import jax


@functools.cache
def compiler_options() -> dict:
    """XLA options for epifit's compiled functions.

    On CPU, XLA's newer MLIR fusion emitters take about twice as long to compile
    the many small fused kernels of an adaptive Runge-Kutta step as the classic
    emitters, for the same or faster run time (measured on the reference problem;
    see `benchmarks/forward.py`). Other backends get no options.
    """
    if jax.default_backend() == "cpu":
        return {"xla_cpu_use_fusion_emitters": False}
    return {}


def jit(fun=None, **kwargs):
    """`jax.jit(fun, **kwargs)` with [`compiler_options`][] added.

    Use it (as `epifit.jit`) to compile losses and gradients built from epifit
    solves; epifit's own entry points (`calibrate`, `simulate`, ...) do.
    """
    if fun is None:
        return functools.partial(jit, **kwargs)
    opts = {**compiler_options(), **kwargs.pop("compiler_options", {})}
    return jax.jit(fun, compiler_options=opts, **kwargs)
