"""The one optimiser of the calibration benchmark, driven by each tool's loss.

`epifit.calibrate`'s own L-BFGS (`epifit.fitting._methods.LBFGS`: memory 10,
Armijo backtracking of at most 30 trials, one `value_and_grad` per loop trip
at the trial point), iterated inside `jax.lax.while_loop` in compiled chunks
of loop trips, with the bookkeeping of epifit's driver
(`epifit/fitting/_optimize.py`): a trip counts as an iteration when the method
says so (`StepInfo.counted`: an accepted step or a retreat, not a
backtracking trial); a trial point whose loss or gradient is not finite (a
solve that failed, with `throw=False`) is a retreat: the iterate stays, the
method shortens its step, and after `MAX_RETREATS` retreats in a row the fit
stops. So every tool's loss is minimised by the algorithm `epifit.calibrate`
runs, and the `epifit` worker's iterates are the `epifit-calibrate` worker's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

CAPACITY = 64  # the most iterations one compiled chunk runs (history buffer)
MEMORY_SIZE = 10
MAX_LINESEARCH_STEPS = 30
MAX_RETREATS = 30  # epifit's default max_retreats

RUNNING, GRADIENT, LOSS, NONFINITE = 0, 1, 2, 3
STATUS = {
    RUNNING: "running",
    GRADIENT: "gradient below tolerance",
    LOSS: "loss change below tolerance",
    NONFINITE: f"{MAX_RETREATS} non-finite steps in a row",
}


def make_lbfgs():
    """epifit's L-BFGS step function with the benchmark's settings."""
    from epifit.fitting._methods import LBFGS

    return LBFGS(memory_size=MEMORY_SIZE, max_linesearch_steps=MAX_LINESEARCH_STEPS)


class _Loss:
    """The objective interface the method steps through: `value_and_grad(x, data)`."""

    def __init__(self, loss):
        import jax

        self._vg = jax.value_and_grad(loss)

    def value_and_grad(self, x, data):
        return self._vg(x, *data)


def make_chunk(loss, ftol: float, gtol: float, patience: int):
    """`(run, init)`: `run(carry, rest, n_end) -> (carry, (loss, grad max-norm,
    evaluations, rejected))` runs L-BFGS iterations of `loss(p, *rest)` until
    `carry["it"] == n_end` or a stop; `init(x, f, g)` is the first carry at a
    point whose loss and gradient were evaluated, `init(x)` one whose first
    loop trip evaluates `x` itself (no step, no iteration: what
    `epifit.calibrate`'s first phase does, so that the fit compiles no
    `value_and_grad` program of its own besides the chunk).

    `carry`: `x, f, g, state, it, trips, flat, bad, status` (see `STATUS`),
    `evals`, `fresh`; `trips` counts the evaluations of the iteration under
    way, `evals` all of them.
    """
    import jax
    import jax.numpy as jnp

    method, fun = make_lbfgs(), _Loss(loss)

    def iterate(c, rest):
        fresh = c["fresh"]
        x, f, g, state, info = method.step(
            c["x"], c["f"], c["g"], c["state"], 1.0, fun, rest, fresh=fresh
        )
        evaluated = (f, g, state)
        bad = info.nonfinite
        counted = jnp.asarray(info.counted) & ~fresh
        keep = lambda new, old: jnp.where(bad, old, new)  # noqa: E731
        x, f, g = keep(x, c["x"]), keep(f, c["f"]), keep(g, c["g"])
        fallback = method.on_nonfinite(c["state"], state, c["x"])
        state = jax.tree.map(keep, state, fallback)
        flat = jnp.abs(c["f"] - f) <= ftol * jnp.abs(f)
        n_flat = jnp.where(bad | ~counted, c["flat"], jnp.where(flat, c["flat"] + 1, 0))
        n_bad = jnp.where(bad, c["bad"] + 1, 0)
        gmax = jnp.max(jnp.abs(g))
        status = jnp.where(
            n_bad >= MAX_RETREATS,
            NONFINITE,
            jnp.where(
                ~bad & (gmax <= gtol * jnp.abs(f)),
                GRADIENT,
                jnp.where((n_flat >= patience) | info.stuck, LOSS, RUNNING),
            ),
        ).astype(jnp.int32)
        trips = c["trips"] + 1
        it = c["it"] + counted.astype(jnp.int32)
        new = dict(x=x, f=f, g=g, state=state, it=it, flat=n_flat, bad=n_bad)
        new.update(status=status, trips=jnp.where(counted, 0, trips))
        new["evals"] = c["evals"] + 1
        # the start's evaluation: its loss, gradient and first direction
        f0, g0, state0 = evaluated
        start = dict(new, f=f0, g=g0, state=state0, x=c["x"], trips=0, flat=0, bad=0)
        start["status"] = jnp.where(bad, NONFINITE, RUNNING).astype(jnp.int32)
        new = jax.tree.map(lambda a, b: jnp.where(fresh, a, b), start, new)
        new["fresh"] = jnp.zeros((), bool)
        return new, (f, gmax, trips, bad.astype(jnp.int32))

    def run(c, rest, n_end):
        start = c["it"]
        dt = c["f"].dtype
        buf = (
            jnp.full((CAPACITY,), jnp.nan, dt),
            jnp.full((CAPACITY,), jnp.nan, dt),
            jnp.zeros((CAPACITY,), jnp.int32),
            jnp.zeros((CAPACITY,), jnp.int32),
        )

        def cond(s):
            c = s[0]
            return (c["status"] == RUNNING) & ((c["it"] < n_end) | c["fresh"])

        def body(s):
            c, buf = s
            # backtracking trials write the slot of the iteration under way;
            # the trip that ends it writes last
            i = c["it"] - start
            c, rec = iterate(c, rest)
            return c, tuple(b.at[i].set(v) for b, v in zip(buf, rec, strict=True))

        return jax.lax.while_loop(cond, body, (c, buf))

    def init(x, f=None, g=None):
        zero = jnp.zeros((), jnp.int32)
        fresh = f is None
        if fresh:  # placeholders: the first trip evaluates x
            f, g = jnp.full((), jnp.nan, x.dtype), jnp.zeros_like(x)
        state, f, g = method.init(x, f, g, fun, ())
        return dict(
            x=x,
            f=f,
            g=g,
            state=state,
            it=zero,
            trips=zero,
            flat=zero,
            bad=zero,
            status=zero,
            evals=zero,
            fresh=jnp.asarray(fresh),
        )

    return run, init


def _compile(loss, x0, rest, run, init, jit) -> tuple[dict, tuple]:
    """Compile the fit, the first carry (its start not evaluated) and the
    chunk (`compile_s`), then, apart, one value-and-gradient of the same loss
    (`grad_compile_s`, the yardstick of the chunk's compile; the fit does
    not use it: its chunk evaluates the start)."""
    import jax
    import jax.numpy as jnp

    rec = {}
    t = time.perf_counter()
    init_c = jax.jit(init).lower(x0).compile()
    carry = jax.eval_shape(init, x0)
    run_c = jit(run).lower(carry, rest, jnp.asarray(1, jnp.int32)).compile()
    rec["compile_s"] = time.perf_counter() - t
    vg = jax.value_and_grad(loss)
    t = time.perf_counter()
    jit(lambda x, rest: vg(x, *rest)).lower(x0, rest).compile()
    rec["grad_compile_s"] = time.perf_counter() - t
    return rec, (init_c, run_c)


def fit(
    loss,
    args: tuple,
    a,
    *,
    jit,
    time_cap: float,
    diagnose: Callable | None = None,
) -> dict:
    """Compile, then run the L-BFGS loop on `loss(p, *rest)` from `args[0]`.

    `compile_s` is the whole fit's compilation (the first carry and the
    chunk; `grad_compile_s`, one value-and-gradient compiled apart, is not
    part of it); `wall_s` and the history's times run from the first
    evaluation (the first chunk's first trip). `diagnose(x)` says why the
    loss is not finite at `x` (for a start that fails).
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    x0, rest = args[0], tuple(args[1:])
    run, init = make_chunk(loss, a.ftol, a.gtol, a.patience)
    rec, (init_c, run_c) = _compile(loss, x0, rest, run, init, jit)
    t0 = time.perf_counter()
    carry, _ = run_c(init_c(x0), rest, jnp.asarray(0, jnp.int32))  # the start
    rec["initial_loss"] = float(carry["f"])
    if int(carry["status"]) == NONFINITE:
        rec.update(wall_s=time.perf_counter() - t0, iterations=0, evaluations=1)
        reason = (diagnose(x0) if diagnose else None) or "no reason reported"
        rec.update(final_loss=None, best_loss=None, converged=False, capped=False)
        rec["status"] = rec["error"] = f"non-finite loss at the start: {reason}"
        return rec
    hist = {"t": [], "loss": [], "grad_max": [], "evals": [], "rejected": []}
    k, capped = 1, False
    while int(carry["it"]) < a.max_iter and int(carry["status"]) == RUNNING:
        it = int(carry["it"])
        n_end = jnp.asarray(min(it + k, a.max_iter), jnp.int32)
        t_chunk = time.perf_counter()
        carry, buf = run_c(carry, rest, n_end)
        buf = [np.asarray(b) for b in jax.block_until_ready(buf)]
        t_end = time.perf_counter()
        done = int(carry["it"]) - it
        e = buf[2][:done].astype(np.float64)
        # an iteration's share of the chunk's time: its gradient evaluations
        w = np.cumsum(e) / max(e.sum(), 1.0)
        hist["t"] += list((t_chunk - t0) + w * (t_end - t_chunk))
        for key, b in zip(("loss", "grad_max"), buf[:2], strict=True):
            hist[key] += b[:done].astype(float).tolist()
        hist["evals"] += buf[2][:done].astype(int).tolist()
        hist["rejected"] += buf[3][:done].astype(int).tolist()
        per = (t_end - t_chunk) / done
        k = int(np.clip(a.chunk_seconds / max(per, 1e-6), 1, CAPACITY))
        if t_end - t0 >= time_cap:
            capped = int(carry["status"]) == RUNNING and int(carry["it"]) < a.max_iter
            break
    rec["wall_s"] = time.perf_counter() - t0
    status = int(carry["status"])
    rec["iterations"] = int(carry["it"])
    rec["evaluations"] = int(carry["evals"])  # the start's included
    rec["rejected_steps"] = int(sum(hist["rejected"]))
    rec["final_loss"] = float(carry["f"])
    rec["best_loss"] = float(min([rec["initial_loss"], *hist["loss"]]))
    rec["grad_max"] = float(jnp.max(jnp.abs(carry["g"])))
    rec["capped"] = capped
    if capped:
        rec["status"] = f"time cap {time_cap:g} s"
    else:
        rec["status"] = STATUS[status] if status else f"iteration cap {a.max_iter}"
    rec["converged"] = status in (GRADIENT, LOSS)
    rec["per_iteration_s"] = rec["wall_s"] / max(rec["iterations"], 1)
    rec["per_evaluation_s"] = rec["wall_s"] / rec["evaluations"]
    rec["history"] = hist
    return rec


def time_to(rec: dict, target: float, slack: float = 0.0) -> float | None:
    """Optimisation wall time at which `rec`'s loss first reached `target`."""
    initial = rec.get("initial_loss")
    if initial is not None and math.isfinite(initial) and initial <= target:
        return 0.0
    hist = rec.get("history") or {}
    bound = target + slack * abs(target)
    for t, f in zip(hist.get("t", []), hist.get("loss", []), strict=False):
        if f <= bound:
            return t
    return None
