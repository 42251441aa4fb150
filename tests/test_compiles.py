"""What a cold fit compiles: counted XLA compiles and traced evaluation sites,
never wall-clock time (`epifit/fitting/README.md`, the cost model)."""

import collections
import contextlib
import logging
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import REPO

import epifit.model._compiled as compiled_module
import epifit.ode._solve as ode_solve_module
from epifit._jit import compiler_options, jit
from epifit.fitting import calibrate
from epifit.fitting._optimize import Optimizer
from epifit.fitting._resolve import fit_config, resolve_fit
from epifit.ode import Result, SolverError, solve
from epifit.simulation import Problem, simulate

SIR = (REPO / "models" / "sir.toml", REPO / "data" / "boarding_school_1978.nc")
NEURAL = (
    REPO / "models" / "seird_metapop_counts.toml",
    REPO / "data" / "synthetic_metapop_20.nc",
)


@contextlib.contextmanager
def count_compiles():
    """`[n]`: the XLA compiles (every backend compile, eager operations
    included) while the block runs."""
    compiler_options()  # its one-off probe compile is not the fit's
    n = [0]

    def listen(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            n[0] += 1

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield n
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


@contextlib.contextmanager
def compiled_names():
    """`[name]`: the programs XLA compiles while the block runs, as the
    compile log names them (`jit(fit_outputs)`; an eager operation's program
    is named after its primitive: `jit(softplus)`, `jit(gather)`), persistent
    cache hits included. Caches are cleared first, so that an eager
    operation already run by another test compiles again and shows."""
    compiler_options()
    jax.clear_caches()
    names = []

    class Listen(logging.Handler):
        def emit(self, record):
            found = re.match(
                r"Finished XLA compilation of (.+) in ", record.getMessage()
            )
            if found:
                names.append(found.group(1))

    logger = logging.getLogger("jax._src.dispatch")
    handler = Listen(logging.DEBUG)
    logger.addHandler(handler)
    try:
        with jax.log_compiles():
            yield names
    finally:
        logger.removeHandler(handler)


@contextlib.contextmanager
def count_vector_fields(monkeypatch):
    """`[n]`: the traces of the model's right-hand side while the block runs
    (each is one copy of the vector field in the program being lowered)."""
    n = [0]
    original = compiled_module.right_hand_side

    def counting(*args, **kwargs):
        n[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(compiled_module, "right_hand_side", counting)
    yield n


@pytest.fixture(scope="module")
def sir():
    return Problem(*SIR)


def _setup(problem, methods):
    config = fit_config(
        None,
        optimizer=[{"method": m, "iterations": 3} for m in methods],
        uncertainty=False,
    )
    setup = resolve_fit(problem, config)
    data = setup.objective.data()
    xs = jax.device_put(np.asarray(setup.objective.free.x0)[None])
    return setup, data, xs


def test_init_params_compiles_nothing():
    """The model's starting values (transforms in NumPy) and the MLP's seeded
    NumPy initialisation: no XLA compile, the same numbers every time."""
    problem = Problem(*NEURAL)
    with count_compiles() as n:
        a = problem.init_params()
    assert n[0] == 0
    b = problem.init_params()
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b) > 4
    for u, v in zip(leaves_a, leaves_b, strict=True):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
    # equinox's default initialisation: uniform on +-1/sqrt(fan-in)
    mlp = a["beta"]
    for layer in mlp.layers:
        lim = 1 / np.sqrt(layer.weight.shape[1])
        assert np.all(np.abs(np.asarray(layer.weight)) <= lim)
        assert np.std(np.asarray(layer.weight)) > 0.2 * lim


@pytest.mark.parametrize("files", [SIR, NEURAL], ids=["sir", "neural"])
def test_a_fit_from_files_compiles_no_eager_operation(files):
    """A fit from the model and data files, as the CLI runs it: binding the
    data, the free vector and the start are set up in NumPy (`epifit._flat`,
    `jax.device_put`), so XLA compiles the optimiser's initialisation, its
    chunk and the output program, and no eager operation's program (the
    data's transfers, `ravel_pytree`'s reshapes and concatenation, the start's
    batch axis each compiled one before)."""
    with compiled_names() as names:
        result = calibrate(
            *files,
            optimizer={"method": "adam", "iterations": 1},
            uncertainty=False,
            progress=False,
        )
    assert names == ["jit(call)", "jit(call)", "jit(fit_outputs)"]
    assert np.isfinite(result.loss)


@pytest.mark.parametrize("files", [SIR, NEURAL], ids=["sir", "neural"])
def test_a_simulation_compiles_one_program(files):
    """`simulate` solves, computes the trajectory's numbers (predictions,
    reproduction number, derived series) and the constrained values in one
    program, `jit(simulation)`, and runs no eager operation (the 20-patch
    counts model's simulation compiled 56 programs before, the solve's
    set-up and each operation of the numbers its own)."""
    with compiled_names() as names:
        ds = simulate(*files)
    assert names == ["jit(simulation)"]
    assert np.isfinite(ds["state"].values).all()


def test_an_eager_solve_is_one_program_compiled_once():
    """`Problem.solve` outside a trace runs one program, compiled at the first
    call and kept: a second call, with other values, compiles nothing (it ran
    each operation eagerly and compiled its loops again at every call, 44
    compiles at first and one of 0.6 s at each call for the neural model),
    and it solves as the same solve traced in a caller's program (float64)."""
    problem = Problem(*NEURAL)
    params = problem.init_params()
    with compiled_names() as names:
        first = problem.solve(params)
    assert names == ["jit(solved)"]
    moved = {**params, "kappa": params["kappa"] + 0.1}
    with compiled_names() as names:
        problem.solve(moved)  # clears the caches: compiles once again
        with count_compiles() as again:
            second = problem.solve(moved)
    assert names == ["jit(solved)"] and again == [0]
    traced = eqx.filter_jit(lambda p: problem.solve(p).ys)(params)
    for k, v in first.ys.items():  # to rounding: another program's fusions
        np.testing.assert_allclose(v, traced[k], rtol=1e-9, atol=1e-300)
    assert not np.array_equal(first.ys["E"], second.ys["E"])


def test_an_eager_solve_takes_python_numbers_as_arguments(sir):
    """Parameters given as Python numbers are the kept program's arguments,
    as arrays are: another value compiles nothing."""
    params = {k: float(v) for k, v in sir.init_params().items()}
    with compiled_names() as names:
        low = sir.solve(params)
        with count_compiles() as again:
            high = sir.solve({**params, "beta": params["beta"] + 0.1})
    assert names == ["jit(solved)"] and again == [0]
    assert high.ys["I"].max() > low.ys["I"].max()


def test_an_eager_solve_that_fails_raises_the_solvers_error(sir):
    """The kept program solves with `throw=False`; a failed solve raises the
    solver's own `SolverError` (segment, time, cause) as the eager solve did,
    and `throw=False` returns its result code."""
    problem = sir
    params = problem.init_params()
    with pytest.raises(SolverError, match=r"segment 0 .*maximum number of steps"):
        problem.solve(params, max_steps=2)
    sol = problem.solve(params, max_steps=2, throw=False)
    assert int(sol.result) == Result.MAX_STEPS_REACHED


def _sir(t, y, args, u):
    beta, gamma = args
    infection = beta * y["S"] * y["I"]
    return {"S": -infection, "I": infection - gamma * y["I"]}


SIR0 = {"S": jnp.array(0.99), "I": jnp.array(0.01)}


def test_an_eager_ode_solve_is_kept_for_its_vector_field():
    """`epifit.ode.solve` outside a trace compiles one program per vector
    field, save times, method and operand structure, kept for the next call:
    other values compile nothing (it compiled its loops again at every call,
    0.4 s for this two-state SIR). It solves as the same solve traced, keeps
    the grid's counts as Python ints, and a failed solve raises the solver's
    error (or, with `throw=False`, returns its code from the same program)."""
    ts = np.arange(30.0)
    with compiled_names() as names:
        first = solve(_sir, SIR0, (0.5, 0.2), ts=ts)
        with count_compiles() as again:
            second = solve(_sir, SIR0, (0.6, 0.2), ts=ts)
    assert names == ["jit(ode_solve)"] and again == [0]
    traced = jax.jit(lambda a: solve(_sir, SIR0, a, ts=ts).ys)((0.5, 0.2))
    np.testing.assert_allclose(first.ys["I"], traced["I"], rtol=1e-12)
    assert second.ys["I"].max() > first.ys["I"].max()  # a larger beta
    assert first.stats["num_segments"] == 29
    assert isinstance(first.stats["num_segments"], int)
    with count_compiles() as n:
        with pytest.raises(SolverError, match=r"segment 0 .*maximum number"):
            solve(_sir, SIR0, (0.5, 0.2), ts=ts, max_steps=1)
        failed = solve(_sir, SIR0, (0.5, 0.2), ts=ts, max_steps=1, throw=False)
    assert n == [1]  # one program: `max_steps` is part of it, `throw` is not
    assert int(failed.result) == Result.MAX_STEPS_REACHED


def test_only_the_most_recent_eager_ode_solves_are_kept(monkeypatch):
    """A vector field made anew for every call does not keep every program
    it compiled: the oldest goes (and compiles again when called again)."""
    monkeypatch.setattr(ode_solve_module, "KEPT_PROGRAMS", 2)
    monkeypatch.setattr(ode_solve_module, "_KEPT", collections.OrderedDict())
    fields = [lambda t, y, a, u, k=k: -(a + k) * y for k in range(3)]
    for f in fields:
        solve(f, jnp.array(1.0), 0.5, ts=[0.0, 1.0])
    assert len(ode_solve_module._KEPT) == 2
    with count_compiles() as n:
        solve(fields[2], jnp.array(1.0), 0.7, ts=[0.0, 1.0])  # kept
    assert n == [0]
    with count_compiles() as n:
        solve(fields[0], jnp.array(1.0), 0.7, ts=[0.0, 1.0])  # gone
    assert n == [1]


def test_a_vector_field_without_the_inputs_argument_is_refused():
    with pytest.raises(TypeError, match=r"must take \(t, y, args, u\).*add the"):
        solve(lambda t, y, args: -y, jnp.array(1.0), ts=[0.0, 1.0])


def test_several_starts_are_screened_by_the_fit_own_first_evaluation(sir):
    """A multi-start fit checks its starting points with the optimiser's
    first evaluation (the first chunk, `Optimizer.first_carry`), not with a
    loss program of their own, and goes on from that evaluation."""
    with compiled_names() as names:
        result = calibrate(
            sir,
            optimizer={"method": "adam", "iterations": 2},
            n_starts=3,
            uncertainty=False,
            progress=False,
        )
    # the seeded perturbations (JAX's generator), then the fit's programs
    *draws, init, chunk, outputs = names
    assert set(draws) <= {"jit(stage)", "jit(_threefry_seed)", "jit(_normal)"}
    assert [init, chunk, outputs] == ["jit(call)", "jit(call)", "jit(fit_outputs)"]
    assert len(result.start_losses) == 3 and np.isfinite(result.loss)


def test_a_forecast_compiles_its_ensemble_program_and_no_transfers(sir):
    """A forecast of a fit compiles its ensemble program once, and no program
    for raveling the free vector, putting the samples and scenario data on
    the device or slicing them into chunks (NumPy, `jax.device_put`)."""
    from epifit.forecasting import forecast

    fit = calibrate(sir, optimizer={"method": "lbfgs", "iterations": 5}, progress=False)
    with compiled_names() as names:
        forecast(fit, days=7, samples=6, chunk_size=4)
    assert names.count("jit(call)") == 1
    moved = ("stage", "reshape", "concatenate", "convert_element_type", "slice")
    assert not [n for n in names if any(m in n for m in moved)], names


@pytest.mark.parametrize(
    "methods, programs",
    [
        # the method's state initialisation and the chunk
        (["adam"], 2),
        # the initialisation and the chunk (its first trip evaluates the start)
        (["lbfgs"], 2),
        # the residuals and Jacobian at the start, the initialisation, the chunk
        (["levenberg_marquardt"], 3),
        # one initialisation per phase, one chunk for both (trial methods)
        (["adam", "lbfgs"], 3),
        # Adam's and L-BFGS's initialisations and their one chunk; the
        # Levenberg-Marquardt phase's Jacobian, initialisation and chunk
        (["adam", "levenberg_marquardt", "lbfgs"], 6),
    ],
)
def test_optimizer_compiles_one_program_per_phase_kind(sir, methods, programs):
    setup, data, xs = _setup(sir, methods)
    optimizer = Optimizer(setup.objective, setup.phases, setup.options)
    with count_compiles() as n:
        out = optimizer.run(xs, data)
    assert out["record"]["iteration"] > 0
    assert out["record"]["phase"] == len(methods)  # every phase ran
    assert n[0] == programs
    # each chunk and initialisation traced once: one dispatch entry each
    # (NumPy leaves in a first call and device arrays later would make two)
    lm = methods.count("levenberg_marquardt")
    chunks = lm + (lm < len(methods))  # LM's own, one for the others
    assert [fn._cache_size() for fn in optimizer._chunks.values()] == [1] * (
        len(methods) + chunks
    )
    # the same optimiser again (e.g. a second start batch): nothing new
    with count_compiles() as n:
        optimizer.run(xs, data)
    assert n[0] == 0


def _chunk_and_evaluation_copies(problem, methods, evaluation, monkeypatch):
    setup, data, xs = _setup(problem, methods)
    objective = setup.objective
    optimizer = Optimizer(objective, setup.phases, setup.options)
    template = optimizer.template(0, xs, data)
    with count_vector_fields(monkeypatch) as n:
        jit(getattr(objective, evaluation)).lower(objective.free.x0, data)
    one = n[0]
    with count_vector_fields(monkeypatch) as n:
        optimizer._chunk_fn(0).lower(template, data, np.int32(1), np.int32(0))
    return n[0], one


@pytest.mark.parametrize(
    "method, evaluation",
    [
        ("adam", "value_and_grad"),
        ("levenberg_marquardt", "residuals_and_jacobian"),
        ("lbfgs", "value_and_grad"),
        # the two phases' program: one evaluation between their switches
        ("adam,lbfgs", "value_and_grad"),
    ],
)
def test_chunk_holds_one_evaluation_site(sir, method, evaluation, monkeypatch):
    """The compiled chunk of a phase traces the vector field as often as one
    evaluation of its objective does: one copy of `value_and_grad` (or of the
    residual Jacobian) whatever the chunk size and the number of phases."""
    chunk, one = _chunk_and_evaluation_copies(
        sir, method.split(","), evaluation, monkeypatch
    )
    assert one > 0
    assert chunk == one


@pytest.mark.parametrize(
    "uncertainty, after",
    [
        # the output program (it solves at the fitted point)
        (False, ["jit(fit_outputs)"]),
        # the residuals' Jacobian with the solve, then the output program
        # from its states (no second solve)
        ("gauss_newton", ["jit(call)", "jit(fit_outputs)"]),
        # the Laplace approximation's own programs, then the output program
        (
            "hessian",
            [
                "jit(data_hessian)",
                "jit(penalty_hessian)",
                "jit(penalty)",
                "jit(fit_outputs)",
            ],
        ),
    ],
)
def test_calibrate_output_path_is_one_program(sir, uncertainty, after, monkeypatch):
    """After the optimiser, a fit compiles its output program (solution,
    R_eff, parameter table, log-likelihood, daily values: one program) and
    the uncertainty method's own, and no eager operation's program."""
    ran = []
    run = Optimizer.run

    def marked(self, *args, **kwargs):
        out = run(self, *args, **kwargs)
        ran.append(len(names))
        return out

    monkeypatch.setattr(Optimizer, "run", marked)
    with compiled_names() as names:
        result = calibrate(
            sir,
            optimizer={"method": "lbfgs", "iterations": 3},
            uncertainty=uncertainty,
            progress=False,
        )
    assert len(ran) == 1
    before, rest = names[: ran[0]], names[ran[0] :]
    # the optimiser: its initialisation and its chunk
    assert before.count("jit(call)") == 2
    assert rest == after
    assert np.isfinite(result.log_likelihood)
    assert result.trajectories["R_eff"].shape[0] == sir.ts.size


def test_an_objective_pickles_without_its_programs(sir):
    """A sampler's worker processes get the objective pickled: its compiled
    programs (local functions, executables) stay behind, and the copy
    compiles its own, to the same numbers."""
    import pickle

    setup, data, xs = _setup(sir, ["adam"])
    objective = setup.objective
    loss = np.asarray(objective.compiled("loss")(xs, data))
    copy = pickle.loads(pickle.dumps(objective))
    assert "_compiled" in objective.__dict__
    assert "_compiled" not in copy.__dict__
    np.testing.assert_array_equal(np.asarray(copy.compiled("loss")(xs, data)), loss)


def test_an_objective_with_a_neural_sub_model_pickles():
    """`sample(chain_method="processes")` pickles the objective: with an MLP
    in the model it failed ("Can't pickle <function silu>"); the copy
    computes the same loss."""
    import pickle

    problem = Problem(REPO / "models" / "seird_metapop_counts.toml",
                      REPO / "data" / "synthetic_metapop_20.nc", days=8)  # fmt: skip
    objective = resolve_fit(problem, fit_config(None)).objective
    data = objective.data()
    x = objective.free.x0[None]
    copy = pickle.loads(pickle.dumps(objective))
    np.testing.assert_array_equal(
        np.asarray(copy.compiled("loss")(x, copy.data())),
        np.asarray(objective.compiled("loss")(x, data)),
    )
