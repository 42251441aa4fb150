"""`epifit.jit`: `jax.jit` with the compiler options epifit's solves want."""

from __future__ import annotations

import functools

import jax

# XLA CPU hands small fusions, such as the error norm of a Runge-Kutta step,
# to the YNNPACK library; for ODE solves that is slower (epifit/README.md).
# The option is experimental, so it is used only where this jaxlib accepts it.
_NO_YNN = {"xla_cpu_experimental_ynn_fusion_type": ""}


@functools.cache
def compiler_options() -> dict:
    """XLA options for epifit's compiled functions.

    On CPU: YNNPACK fusions off (see `_NO_YNN`), where the installed jaxlib
    knows the option; no options on other backends.

    The one place to set backend options for every compiled loss, gradient
    and fit loop. An option earns its place here only when measured on the
    reference problem (`benchmarks/forward.py`, `benchmarks/gradient.py`) and
    checked for correctness; the options tried and their measured effects are
    recorded in `epifit/README.md`.
    """
    if jax.default_backend() != "cpu":
        return {}
    try:
        jax.jit(lambda x: x + 1, compiler_options=_NO_YNN).lower(1.0).compile()
    except Exception:  # an option this jaxlib does not know
        return {}
    return dict(_NO_YNN)


def jit(fun=None, **kwargs):
    """`jax.jit(fun, **kwargs)` with epifit's XLA options added (on CPU:
    YNNPACK fusions off where the installed jaxlib knows the option).

    Use it (as `epifit.jit`) to compile losses and gradients built from epifit
    solves; epifit's own entry points (`calibrate`, `simulate`, ...) do.
    """
    if fun is None:
        return functools.partial(jit, **kwargs)
    opts = {**compiler_options(), **kwargs.pop("compiler_options", {})}
    if opts:
        kwargs["compiler_options"] = opts
    return jax.jit(fun, **kwargs)
