"""The sampler's one compiled program (`epifit/sampling/_nuts.py`,
`_adapt.py`): its warm-up is blackjax's window adaptation, transition by
transition, whatever the chunking; a run compiles NUTS once."""

from pathlib import Path

import blackjax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_compiles import compiled_names

from epifit.sampling._adapt import DRAW, LAST, SLOW, WINDOW_END, codes
from epifit.sampling._nuts import (
    WARMUP_STREAM,
    NutsSettings,
    Programs,
    run_chain,
    total_draws,
)

# a correlated Gaussian with scales 100x apart, so both the step size and the
# mass matrix have something to adapt to
COV = np.array([[4.0, 1.2, 0.0], [1.2, 1.0, -0.03], [0.0, -0.03, 0.0004]])
PRECISION = np.linalg.inv(COV)
X0 = np.array([1.0, -0.5, 0.01])


def logdensity(x, data):
    return -0.5 * x @ data @ x


def _warmup_key(seed, chain):
    base = jax.random.fold_in(jax.random.key(seed), chain)
    return jax.random.fold_in(base, WARMUP_STREAM)


def test_the_schedule_is_stans():
    """Codes of blackjax's schedule: fast, slow windows ending with a
    recomputed mass matrix, the last warm-up transition marked; no warm-up
    no codes."""
    c = codes(100)
    assert c.shape == (100,) and c.dtype == np.int32
    assert not np.any(c & DRAW)
    assert np.flatnonzero(c & LAST).tolist() == [99]
    slow = np.flatnonzero(c & SLOW)
    assert slow[0] == 15 and slow[-1] == 89  # 15% fast, 10% fast at the end
    assert np.all(c[np.flatnonzero(c & WINDOW_END)] & SLOW)
    assert codes(0).shape == (0,)
    assert np.all(codes(10) & ~LAST == 0)  # under 20: all fast


@pytest.mark.parametrize("mass_matrix", ["diagonal", "dense"])
def test_warmup_ends_where_blackjax_window_adaptation_ends(mass_matrix):
    """After 100 warm-up transitions run in chunks of 7 (the warm-up's end
    inside a chunk), the chain's state, step size and inverse mass matrix
    are those of blackjax's `window_adaptation` from the same key and first
    inverse mass matrix, to rounding; chunks of 50 give the same draws."""
    warmup = 100
    imm0 = np.ones(3) if mass_matrix == "diagonal" else np.eye(3)
    settings = NutsSettings(chains=1, warmup=warmup, draws=20, chunk=7,
                            mass_matrix=mass_matrix, seed=3)  # fmt: skip
    data = jnp.asarray(PRECISION)
    ours = run_chain(Programs(logdensity, settings), 0, X0, imm0, data)

    adapt = blackjax.window_adaptation(
        blackjax.nuts,
        lambda x: logdensity(x, data),
        is_mass_matrix_diagonal=mass_matrix == "diagonal",
        initial_inverse_mass_matrix=jnp.asarray(imm0),
    )
    (state, params), _ = adapt.run(_warmup_key(3, 0), jnp.asarray(X0), warmup)
    np.testing.assert_allclose(ours["step_size"], params["step_size"], rtol=1e-10)
    np.testing.assert_allclose(
        ours["inverse_mass_matrix"], params["inverse_mass_matrix"], rtol=1e-10
    )
    # its first draw moved on from blackjax's last warm-up state
    kernel = blackjax.nuts(lambda x: logdensity(x, data), **params)
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(3), 0), 0)
    first, _ = kernel.step(key, state)
    np.testing.assert_allclose(ours["positions"][0], first.position, rtol=1e-9)
    assert ours["positions"].shape == (20, 3)
    assert total_draws(settings) == 18 * 7 - warmup  # whole chunks: 26 run

    bigger = run_chain(Programs(logdensity, settings.__class__(
        **{**settings.__dict__, "chunk": 50})), 0, X0, imm0, data)  # fmt: skip
    np.testing.assert_array_equal(bigger["positions"], ours["positions"])
    np.testing.assert_array_equal(bigger["step_size"], ours["step_size"])


def test_without_warmup_the_chain_draws_at_step_one():
    """`warmup=0`: no adaptation, the first inverse mass matrix and step
    size 1 throughout; the draws are NUTS's from the start."""
    settings = NutsSettings(chains=1, warmup=0, draws=10, chunk=5, seed=1)
    data = jnp.asarray(PRECISION)
    ours = run_chain(Programs(logdensity, settings), 0, X0, np.ones(3), data)
    assert ours["step_size"] == 1.0
    np.testing.assert_array_equal(ours["inverse_mass_matrix"], np.ones(3))
    kernel = blackjax.nuts(lambda x: logdensity(x, data), 1.0, jnp.ones(3))
    state = kernel.init(jnp.asarray(X0))
    for i in range(3):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(1), 0), i)
        state, _ = kernel.step(key, state)
        np.testing.assert_allclose(ours["positions"][i], state.position, rtol=1e-12)


def test_chains_compile_one_program():
    """Three chains, warm-up and draws: one program compiled (it was a
    warm-up program and a chunk program, each holding NUTS and the
    gradient); the chains vmapped: one more, their own."""
    settings = NutsSettings(chains=3, warmup=30, draws=20, chunk=10)
    data = jnp.asarray(PRECISION)
    with compiled_names() as names:
        programs = Programs(logdensity, settings)
        for c in range(3):
            run_chain(programs, c, X0 + c, np.ones(3), data)
    assert names.count("jit(steps)") == 1
    assert not [n for n in names if "warm" in n or "chunk" in n]
    assert programs._steps._cache_size() == 1  # one trace: the carry kept its types


def test_the_program_traces_the_density_once():
    """blackjax's NUTS traces its density more than once (its integrator's
    loop body until the carry's weak types settle, and its `init`); the
    program hands it the density under `jax.jit`, so its body is traced
    once, the later traces cache hits. (That the draws are NUTS's own:
    `test_without_warmup_the_chain_draws_at_step_one`.)"""
    data = jnp.asarray(PRECISION)
    calls = []

    def counted(x, data):
        calls.append(1)
        return logdensity(x, data)

    settings = NutsSettings(chains=1, warmup=10, draws=5, chunk=15)
    run_chain(Programs(counted, settings), 0, X0, np.ones(3), data)
    assert len(calls) == 1
    # blackjax's own kernel, the density not jitted: traced more than once
    calls.clear()
    kernel = blackjax.nuts(lambda x: counted(x, data), 1.0, jnp.ones(3))
    jax.jit(lambda k, x: kernel.step(k, kernel.init(x))).lower(
        jax.random.key(0), jnp.asarray(X0)
    )
    assert len(calls) > 1  # (4 with blackjax 1.7)


def test_progress_counts_every_transition_and_checkpoints_follow_the_warmup():
    """`on_progress` sees the transitions done at the start and after every
    chunk, warm-up included (a progress bar's count); `on_chunk` the
    snapshots a checkpoint saves: from the chunk that ends the warm-up, with
    the draws done."""
    settings = NutsSettings(chains=1, warmup=25, draws=20, chunk=10)
    seen, snaps = [], []
    run_chain(Programs(logdensity, settings), 0, X0, np.ones(3),
              jnp.asarray(PRECISION), on_chunk=lambda s: snaps.append(s["done"]),
              on_progress=seen.append)  # fmt: skip
    assert seen == [0, 10, 20, 30, 40, 50]
    assert snaps == [5, 15, 25]  # the chunk of transitions 20-29 ends the warm-up


@pytest.mark.parametrize(
    ("model", "fit", "forward"),
    [
        ("sir", {}, True),  # 3 free parameters x 3 states
        ("sir", {"adjoint": "checkpoint"}, False),  # the fit file's adjoint
        ("metapop", {}, False),  # 199 free parameters
    ],
)
def test_the_density_takes_its_gradient_in_forward_mode_only_when_small(
    model, fit, forward
):
    """`Objective.forward_pays`: forward mode with the default adjoint, at
    most 16 free parameters and free parameters x states at most 64;
    `LogDensity.gradient` says which. No solve: the rule reads the problem's
    sizes."""
    import xarray as xr

    from epifit.fitting import fit_config, resolve_fit
    from epifit.fitting._objective import FORWARD_MAX_WORK
    from epifit.model import load_model
    from epifit.sampling._density import LogDensity
    from epifit.simulation import Problem

    root = Path(__file__).resolve().parents[1]
    if model == "metapop":
        spec, data = "seird_metapop_counts", "synthetic_metapop_20"
    else:
        spec, data = model, "boarding_school_1978"
    ds = xr.open_dataset(root / "data" / f"{data}.nc").load()
    problem = Problem(load_model(root / "models" / f"{spec}.toml"), ds)
    objective = resolve_fit(problem, fit_config(fit)).objective
    assert objective.free.n == {"sir": 3, "metapop": 199}[model]
    assert problem.n_states == {"sir": 3, "metapop": 16 * 20}[model]
    if model == "sir":
        assert objective.free.n * problem.n_states <= FORWARD_MAX_WORK
    assert objective.forward_pays is forward
    assert LogDensity(objective).gradient == ("forward" if forward else "adjoint")


def test_a_start_is_pulled_to_a_finite_density_in_the_program():
    """A chain whose start is outside the density's support begins between
    it and the anchor (the MAP), in the chains' own program; with the
    anchor outside too, the chain raises after its first chunk instead of
    wandering from a non-finite state."""
    settings = NutsSettings(chains=1, warmup=10, draws=10, chunk=10)
    data = jnp.asarray(PRECISION)

    def boxed(x, data):  # the Gaussian, inside |x| < 2 only
        inside = jnp.max(jnp.abs(x)) < 2.0
        return jnp.where(inside, logdensity(x, data), -jnp.inf)

    far = np.array([40.0, 0.0, 0.0])
    out = run_chain(Programs(boxed, settings, np.zeros(3)), 0, far, np.ones(3), data)
    positions = np.asarray(out["positions"])
    assert np.all(np.isfinite(positions)) and np.all(np.abs(positions) < 2.0)
    # an anchor just outside: NUTS could step in from it, but the begun
    # state is NaN, which no transition leaves
    edge = np.array([2.05, 0.0, 0.0])
    with pytest.raises(FloatingPointError, match="not finite at the MAP"):
        run_chain(Programs(boxed, settings, edge), 0, far, np.ones(3), data)


def test_a_start_far_below_the_map_density_is_pulled_in_the_program():
    """A start whose density is finite but far below the MAP's begins the
    chain nearer the MAP, in the chains' program: without the pull the
    warm-up adapts to where it starts and the chain stays out there."""
    settings = NutsSettings(chains=1, warmup=10, draws=10, chunk=10)
    data = jnp.asarray(PRECISION)
    far = np.array([1e4, 0.0, 0.0])
    out = run_chain(Programs(logdensity, settings, np.zeros(3)), 0, far, np.ones(3),
                    data)  # fmt: skip
    positions = np.asarray(out["positions"])
    assert np.all(np.isfinite(positions)) and np.abs(positions).max() < 50.0
