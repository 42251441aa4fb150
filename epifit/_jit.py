"""`epifit.jit`: `jax.jit` with the compiler options epifit's solves want."""

from __future__ import annotations

import functools

import equinox as eqx
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


# A program evaluated once and cheaply (a small model's Hessian or outputs)
# is compiled with LLVM's optimisations off: on the boarding-school SIR the
# forward-over-forward Hessian compiled in 1.37-1.46 s against 1.87-1.92 s
# and ran in 1.9 against 0.4-0.6 ms (epifit/README.md).
_ONCE = {"xla_backend_optimization_level": 0}

# A fit's output program and a simulation run once, so up to this many
# states (every compartment's stages in every cell: the 280-patch reference
# problem's 16 x 280) they are compiled with LLVM's optimisations off
# (`jit(once=True)`; `Problem.compile_once`).
# Measured 2026-12-06, lowering apart, two processes each: the 20-patch
# counts model (320 states) compiled in 0.89-0.99 s against 1.54-1.66 s and
# ran in 13-15 ms against 5 ms; the reference problem (4480 states, float32)
# 1.14-1.38 s against 1.94-2.03 s, run 0.87-0.91 s against 0.48-0.52 s (its
# spectral radius of the next-generation matrix on 120 days is most of it):
# a gain of 0.6 and 0.2-0.5 s. Larger models keep the optimised program,
# whose evaluation (a solve and the reproduction number's eigenproblems)
# grows faster than its compile.
ONCE_MAX_STATES = 4480


@functools.cache
def once_options() -> dict:
    """XLA options for a program evaluated once whose evaluation is cheap
    (see `jit(once=True)`): on CPU, LLVM at optimisation level 0 (on top of
    `compiler_options`); no options on other backends."""
    if jax.default_backend() != "cpu":
        return {}
    return {**compiler_options(), **_ONCE}


def jit(fun=None, *, once: bool = False, **kwargs):
    """`jax.jit(fun, **kwargs)` with epifit's XLA options added (on CPU:
    YNNPACK fusions off where the installed jaxlib knows the option).

    Use it (as `epifit.jit`) to compile losses and gradients built from epifit
    solves; epifit's own entry points (`calibrate`, `simulate`, ...) do.
    With `once`, the program is compiled for one cheap evaluation
    (`once_options`: less time compiling, slower code); for a program whose
    evaluation takes far less than its compile.
    """
    if fun is None:
        return functools.partial(jit, once=once, **kwargs)
    base = once_options() if once else compiler_options()
    opts = {**base, **kwargs.pop("compiler_options", {})}
    if opts:
        kwargs["compiler_options"] = opts
    return jax.jit(fun, **kwargs)


def split_concrete(operands, *key):
    """`(dynamic, static, key)` for calling a kept compiled function on
    `operands` outside a trace: their array-like leaves (Python numbers too:
    the function's arguments), the rest (closed over, such as an MLP's
    activation), and a hashable key of `key` with that rest's structure and
    leaves; `None` where a leaf is a tracer or the key cannot be hashed.

    For `epifit.ode.solve` and `Problem.solve` called eagerly: one program
    per key, kept, instead of one per JAX operation at every call.
    """
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(operands)):
        return None
    dynamic, static = eqx.partition(operands, eqx.is_array_like)
    leaves, treedef = jax.tree.flatten(static)
    full = (*key, treedef, tuple(leaves))
    try:
        hash(full)
    except TypeError:
        return None
    return dynamic, static, full
