"""The one optimiser of the calibration benchmark, driven by each tool's loss.

`optax.lbfgs` (memory 10) with its zoom line search (at most 30 steps,
initial step 1), the settings of `epifit.calibrate`'s `lbfgs` phase, iterated
inside `jax.lax.while_loop` in compiled chunks of iterations, with epifit's
treatment of non-finite values (`epifit/fitting/_optimize.py`,
`_methods.LBFGS`): a trial point of the line search whose loss is not finite
(a solve that failed, with `throw=False`) makes the zoom back off; a step whose
loss or gradient is still not finite, or a line search that met only
non-finite values, is rejected: the iterate stays where it was, the memory
restarts, and after `MAX_RETREATS` rejections in a row the fit stops.
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
    import optax

    return optax.lbfgs(
        memory_size=MEMORY_SIZE,
        linesearch=optax.scale_by_zoom_linesearch(
            max_linesearch_steps=MAX_LINESEARCH_STEPS, initial_guess_strategy="one"
        ),
    )


def _step(tx, c, value_fn):
    """One L-BFGS iteration from the carry `c`, as `epifit.fitting`'s `LBFGS.step`:
    `(x, f, g, state, evaluations, rejected)`."""
    import jax
    import jax.numpy as jnp
    import optax

    u, state = tx.update(
        c["g"], c["state"], c["x"], value=c["f"], grad=c["g"], value_fn=value_fn
    )
    info = optax.tree_utils.tree_get(state, "info")
    f = optax.tree_utils.tree_get(state, "value")
    g = optax.tree_utils.tree_get(state, "grad")
    # a zero step: the line search found no decrease. If it met only
    # non-finite values (an infinite decrease error), the step failed;
    # otherwise the memory restarts and the iteration counts as flat
    no_step = jnp.all(u == 0)
    bad = ~(jnp.isfinite(f) & jnp.all(jnp.isfinite(g)))
    bad = bad | (no_step & jnp.isinf(info.decrease_error))
    restart = no_step | bad
    state = jax.tree.map(lambda a, b: jnp.where(restart, a, b), tx.init(c["x"]), state)
    keep = no_step | bad
    x = jnp.where(keep, c["x"], c["x"] + u)
    f = jnp.where(keep, c["f"], f)
    g = jnp.where(keep, c["g"], g)
    return x, f, g, state, info.num_linesearch_steps.astype(jnp.int32), bad


def make_chunk(loss, ftol: float, gtol: float, patience: int):
    """`(run, init)`: `run(carry, rest, n_end) -> (carry, (loss, grad max-norm,
    evaluations, rejected))` runs L-BFGS iterations of `loss(p, *rest)` until
    `carry["it"] == n_end` or a stop; `init(x, f, g)` is the first carry.

    `carry`: `x, f, g, state, it, flat, bad, status` (see `STATUS`).
    """
    import jax
    import jax.numpy as jnp

    tx = make_lbfgs()

    def iterate(c, rest):
        x, f, g, state, evals, bad = _step(tx, c, lambda y: loss(y, *rest))
        flat = jnp.abs(c["f"] - f) <= ftol * jnp.abs(f)
        n_flat = jnp.where(bad, c["flat"], jnp.where(flat, c["flat"] + 1, 0))
        n_bad = jnp.where(bad, c["bad"] + 1, 0)
        gmax = jnp.max(jnp.abs(g))
        status = jnp.where(
            n_bad >= MAX_RETREATS,
            NONFINITE,
            jnp.where(
                ~bad & (gmax <= gtol * jnp.abs(f)),
                GRADIENT,
                jnp.where(n_flat >= patience, LOSS, RUNNING),
            ),
        ).astype(jnp.int32)
        new = dict(x=x, f=f, g=g, state=state, it=c["it"] + 1, flat=n_flat)
        new.update(bad=n_bad, status=status)
        return new, (f, gmax, evals, bad.astype(jnp.int32))

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
            return (s[0]["status"] == RUNNING) & (s[0]["it"] < n_end)

        def body(s):
            c, buf = s
            i = c["it"] - start
            c, rec = iterate(c, rest)
            return c, tuple(b.at[i].set(v) for b, v in zip(buf, rec, strict=True))

        return jax.lax.while_loop(cond, body, (c, buf))

    def init(x, f, g):
        zero = jnp.zeros((), jnp.int32)
        return dict(
            x=x, f=f, g=g, state=tx.init(x), it=zero, flat=zero, bad=zero, status=zero
        )

    return run, init


def _compile(loss, x0, rest, run, init, jit) -> tuple[dict, tuple]:
    """Compile the value-and-gradient, the first carry and the chunk."""
    import jax
    import jax.numpy as jnp

    vg = jax.value_and_grad(loss)
    rec = {}
    t = time.perf_counter()
    vg_c = jit(lambda x, rest: vg(x, *rest)).lower(x0, rest).compile()
    rec["grad_compile_s"] = time.perf_counter() - t
    f_g = jax.eval_shape(lambda x: vg(x, *rest), x0)
    init_c = jax.jit(init).lower(x0, *f_g).compile()
    carry = jax.eval_shape(init, x0, *f_g)
    run_c = jit(run).lower(carry, rest, jnp.asarray(1, jnp.int32)).compile()
    rec["compile_s"] = time.perf_counter() - t
    return rec, (vg_c, init_c, run_c)


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

    `compile_s` is the whole fit's compilation (`grad_compile_s` of it the
    value-and-gradient's); `wall_s` and the history's times run from the
    first value-and-gradient evaluation. `diagnose(x)` says why the loss is
    not finite at `x` (for a start that fails).
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    x0, rest = args[0], tuple(args[1:])
    run, init = make_chunk(loss, a.ftol, a.gtol, a.patience)
    rec, (vg_c, init_c, run_c) = _compile(loss, x0, rest, run, init, jit)
    t0 = time.perf_counter()
    f0, g0 = jax.block_until_ready(vg_c(x0, rest))
    rec["initial_loss"] = float(f0)
    if not (np.isfinite(float(f0)) and bool(jnp.all(jnp.isfinite(g0)))):
        rec.update(wall_s=time.perf_counter() - t0, iterations=0, evaluations=1)
        reason = (diagnose(x0) if diagnose else None) or "no reason reported"
        rec.update(final_loss=None, best_loss=None, converged=False, capped=False)
        rec["status"] = rec["error"] = f"non-finite loss at the start: {reason}"
        return rec
    carry = init_c(x0, f0, g0)
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
    rec["evaluations"] = 1 + int(sum(hist["evals"]))
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
