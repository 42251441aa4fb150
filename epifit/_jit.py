"""`epifit.jit`: `jax.jit` with the compiler options epifit's solves want."""

from __future__ import annotations

import functools

import jax

# XLA CPU hands small fusions, such as the error norm of a Runge-Kutta step,
# to the YNNPACK library; for ODE solves that is slower (measured on the
# reference problem, interleaved in one process: loss 45.0 vs 50.1 ms, gradient
# 160 vs 168 ms median). The option is experimental, so it is used only where
# this jaxlib accepts it.
_NO_YNN = {"xla_cpu_experimental_ynn_fusion_type": ""}


@functools.cache
def compiler_options() -> dict:
    """XLA options for epifit's compiled functions.

    On CPU: YNNPACK fusions off (see `_NO_YNN`), where the installed jaxlib
    knows the option; no options on other backends.

    The one place to set backend options for every compiled loss, gradient
    and fit loop. An option earns its place here only when measured on the
    reference problem (`benchmarks/forward.py`, `benchmarks/gradient.py`) and
    checked for correctness. For the record, XLA CPU's classic emitters
    (`xla_cpu_use_fusion_emitters=False`, used until 2026-11) compile an
    adaptive solve about 1.6x faster, but run its loss 1.5x and its gradient
    1.25x slower and, with jaxlib 0.10.2, miscompile the forward-mode Jacobian
    of the 280-patch reference loss (8.8% relative error, against 4e-6 with the
    default emitters), so they are not used.
    """
    if jax.default_backend() != "cpu":
        return {}
    try:
        jax.jit(lambda x: x + 1, compiler_options=_NO_YNN).lower(1.0).compile()
    except Exception:  # an option this jaxlib does not know
        return {}
    return dict(_NO_YNN)


def jit(fun=None, **kwargs):
    """`jax.jit(fun, **kwargs)` with [`compiler_options`][] added.

    Use it (as `epifit.jit`) to compile losses and gradients built from epifit
    solves; epifit's own entry points (`calibrate`, `simulate`, ...) do.
    """
    if fun is None:
        return functools.partial(jit, **kwargs)
    opts = {**compiler_options(), **kwargs.pop("compiler_options", {})}
    if opts:
        kwargs["compiler_options"] = opts
    return jax.jit(fun, **kwargs)
