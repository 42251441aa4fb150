"""The optimisation methods, schedules, stopping rules and the progress bar, on
small functions with known minima."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_calibrate_robust import Toy

from epifit.fitting._chunk import GRADIENT, LOSS
from epifit.fitting._config import PhaseConfig, parse_phases
from epifit.fitting._methods import make_method
from epifit.fitting._optimize import OptimizeOptions, Optimizer
from epifit.fitting._progress import ProgressBar, progress_enabled

TARGET = np.array([1.0, -2.0, 0.5])
SCALES = np.array([1.0, 3.0, 10.0])


def residuals(x):
    """A least-squares bowl with its minimum (0) at TARGET."""
    return SCALES * (x - TARGET)


def rosenbrock(x):
    return jnp.stack([10.0 * (x[1] - x[0] ** 2), 1.0 - x[0]])


def run(phases, x0, r=residuals, **options):
    phases = parse_phases(phases)
    opt = Optimizer(Toy(r), phases, OptimizeOptions(**options))
    return opt.run(jnp.asarray(x0, float), None)


@pytest.mark.parametrize(
    "phase",
    [
        {"method": "adam", "iterations": 3000, "learning_rate": 0.05},
        {
            "method": "adam",
            "iterations": 3000,
            "learning_rate": 0.1,
            "schedule": "cosine",
        },
        {
            "method": "adam",
            "iterations": 3000,
            "learning_rate": 0.1,
            "schedule": "warmup_cosine",
            "warmup_steps": 50,
        },
        {
            "method": "adam",
            "iterations": 3000,
            "learning_rate": 0.1,
            "schedule": "exponential",
            "decay_rate": 0.5,
            "transition_steps": 300,
            "clip": 10.0,
        },
        {
            "method": "rmsprop",
            "iterations": 3000,
            "learning_rate": 0.01,
            "momentum": 0.5,
            "decay": 0.9,
            "schedule": "exponential",
            "decay_rate": 0.5,
            "transition_steps": 200,
        },
        {
            "method": "sgd",
            "iterations": 3000,
            "learning_rate": 0.004,
            "momentum": 0.9,
            "nesterov": True,
        },
        {"method": "lbfgs", "iterations": 100},
        {"method": "levenberg_marquardt", "iterations": 100},
        {"method": "gauss_newton", "iterations": 100},
    ],
    ids=lambda p: "-".join(str(v) for k, v in p.items() if k in ("method", "schedule")),
)
def test_every_method_finds_the_minimum(phase):
    out = run(phase, [[0.0, 0.0, 0.0]], tolerance=1e-7, loss_tolerance=0.0)
    x = np.asarray(out["carry"].x[0])
    tol = 1e-5 if phase["method"] in ("adam", "rmsprop", "sgd") else 1e-8
    np.testing.assert_allclose(x, TARGET, atol=tol)
    assert out["record"]["statuses"] == [[GRADIENT]]


def test_least_squares_methods_are_fast_on_rosenbrock():
    """Levenberg-Marquardt and L-BFGS both solve Rosenbrock from (-1.2, 1)."""
    for phase, cap in (("levenberg_marquardt", 60), ("lbfgs", 100)):
        out = run(phase, [[-1.2, 1.0]], r=rosenbrock, tolerance=1e-10)
        np.testing.assert_allclose(out["carry"].x[0], [1.0, 1.0], atol=1e-6)
        assert out["record"]["iteration"] <= cap, phase


def test_phases_chain_and_histories():
    phases = [{"method": "adam", "iterations": 30, "learning_rate": 0.05}, "lbfgs"]
    out = run(phases, [[0.0, 0.0, 0.0]], tolerance=1e-9)
    rec = out["record"]
    phase = rec["history"]["phase"][0]
    assert (phase[:30] == 0).all() and (phase[30:] == 1).all()
    assert len(rec["history"]["loss"][0]) == rec["iteration"]
    assert len(rec["statuses"]) == 2
    loss = rec["history"]["loss"][0]
    assert loss[-1] < 1e-12 < loss[0]


def test_first_optimiser_matches_optax_directly():
    """The first-order phase is the optax transformation, step for step."""
    x0 = jnp.zeros(3)
    out = run(
        {"method": "adam", "iterations": 25, "learning_rate": 0.1},
        x0[None, :],
        loss_tolerance=0.0,
        tolerance=0.0,
    )
    tx = optax.adam(0.1)
    state = tx.init(x0)
    x = x0
    loss = lambda x: jnp.sum(jnp.square(residuals(x)))  # noqa: E731
    for _ in range(25):
        u, state = tx.update(jax.grad(loss)(x), state, x)
        x = x + u
    np.testing.assert_allclose(out["carry"].x[0], x, rtol=1e-12)


def test_an_optax_phase_is_the_named_method():
    """A phase given as `optax.adam(0.1)` is the phase `adam` with learning
    rate 0.1, bit for bit (the same transformation, the same loop)."""
    x0 = jnp.zeros((1, 3))
    named = run({"method": "adam", "iterations": 25, "learning_rate": 0.1}, x0)
    given = run({"method": optax.adam(0.1), "iterations": 25}, x0)
    np.testing.assert_array_equal(given["carry"].x, named["carry"].x)
    np.testing.assert_array_equal(
        given["record"]["history"]["loss"][0], named["record"]["history"]["loss"][0]
    )


def test_iteration_cap_and_time_budget():
    slow = {"method": "adam", "iterations": 1000, "learning_rate": 1e-4}
    out = run(slow, [[0.0, 0.0, 0.0]], max_iterations=17, chunk_size=5)
    assert out["record"]["iteration"] == 17
    out = run([slow, "lbfgs"], [[0.0, 0.0, 0.0]], max_iterations=17)
    assert "iteration cap of 17 reached in phase 1 (adam)" in out["stop_reason"]
    out = run(slow, [[0.0, 0.0, 0.0]], time_budget=1e-9, chunk_size=3)
    assert out["record"]["iteration"] == 3
    assert out["stop_reason"].startswith("time budget of 1e-09 s reached after 3")


def test_loss_tolerance_stops_a_stalled_phase():
    """A nearly flat loss (gradient 2e-9, never below tolerance 0): the loss
    changes by less than 1e-10 (relative) for `patience` iterations."""
    flat = lambda x: 1.0 + 1e-9 * x  # noqa: E731
    out = run(
        {"method": "adam", "iterations": 100, "learning_rate": 0.01},
        [[1.0]],
        r=flat,
        tolerance=0.0,
        loss_tolerance=1e-10,
        patience=4,
    )
    assert out["record"]["statuses"] == [[LOSS]]
    assert out["record"]["iteration"] == 4


def test_progress_bar(capsys):
    assert progress_enabled(False) is False and progress_enabled(True) is True
    assert progress_enabled("auto") is False  # pytest captures stderr
    with pytest.raises(ValueError, match="progress must be True, False or 'auto'"):
        progress_enabled("yes")
    phases = parse_phases(["adam", "lbfgs"])
    opt = Optimizer(Toy(residuals), phases, OptimizeOptions(tolerance=1e-9))
    with ProgressBar(phases, n_starts=2) as bar:
        opt.progress = bar
        opt.run(jnp.zeros((2, 3)), None)
    err = capsys.readouterr().err
    assert "1/2 adam x2 starts" in err and "2/2 lbfgs" in err and "loss" in err


def test_make_method_reads_options():
    m = make_method(PhaseConfig("lbfgs", 5, options=(("memory_size", 3),)))
    assert m.memory_size == 3
    assert make_method(PhaseConfig("gauss_newton", 5)).damping == 0.0


def test_lbfgs_backtracking_trials_are_not_iterations():
    """L-BFGS evaluates one trial point per loop trip; the trials its
    backtracking rejects are not iterations: on Rosenbrock every recorded
    iteration is a step that lowers the loss (Armijo), and there are more
    evaluations than iterations."""
    calls = []

    class Counting(Toy):
        def value_and_grad(self, x, data):
            jax.debug.callback(lambda: calls.append(1))
            return super().value_and_grad(x, data)

    opt = Optimizer(Counting(rosenbrock), parse_phases(["lbfgs"]), OptimizeOptions())
    out = opt.run(jnp.asarray([[-1.2, 1.0]]), None)
    rec = out["record"]
    loss, step = rec["history"]["loss"][0], rec["history"]["step"][0]
    assert rec["statuses"] == [[GRADIENT]]
    assert len(loss) == rec["iteration"] > 10
    assert np.all(np.diff(np.concatenate([rec["initial_loss"], loss])) < 0)
    assert np.all(step > 0)
    assert len(calls) > rec["iteration"] + 1  # rejected trials, the start


def test_phases_in_one_program_step_as_each_alone():
    """Adam then L-BFGS run in one compiled program (the phase an argument,
    one evaluation site): each phase takes the steps it takes run alone from
    the same point, with its own stopping rule (L-BFGS's tolerance here)."""
    adam = {"method": "adam", "iterations": 40, "learning_rate": 0.05}
    lbfgs = {"method": "lbfgs", "iterations": 200, "tolerance": 1e-3}
    x0 = jnp.asarray([[-1.2, 1.0], [0.5, 0.5]])
    both = Optimizer(Toy(rosenbrock), parse_phases([adam, lbfgs]), OptimizeOptions())
    assert len(both._chunks) == 0 and set(both.members) == {"trial"}
    out = both.run(x0, None)
    assert len([k for k in both._chunks if k != ("init", 0) and k != ("init", 1)]) == 1
    first = Optimizer(Toy(rosenbrock), parse_phases([adam]), OptimizeOptions())
    a = first.run(x0, None)
    second = Optimizer(Toy(rosenbrock), parse_phases([lbfgs]), OptimizeOptions())
    b = second.run(a["carry"].x, None)
    for s in range(2):
        for key in ("loss", "grad_norm", "step"):
            np.testing.assert_array_equal(
                out["record"]["history"][key][s],
                np.concatenate(
                    [a["record"]["history"][key][s], b["record"]["history"][key][s]]
                ),
            )
    np.testing.assert_array_equal(out["carry"].x, b["carry"].x)
    assert out["record"]["statuses"][1] == b["record"]["statuses"][0] == [GRADIENT] * 2
    # the L-BFGS phase stopped on its own tolerance, well before its budget
    assert len(b["record"]["history"]["loss"][0]) < 200
