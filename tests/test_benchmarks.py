"""The benchmarks run: `benchmarks/forward.py` and `benchmarks/gradient.py` on a
small reference problem, epifit only, write the JSON records the issues ask
for, and the gradient they time agrees with the float64 reference
(`benchmarks/reference/peers.py`'s `reference`); `benchmarks/calibrate.py`
writes its records and reports a peer that fails with its reason; the peers'
losses and the benchmark optimiser treat non-finite values as epifit's
optimiser does. (Speed is measured by `make bench`, never here.)"""

import json
import subprocess
import sys
from pathlib import Path

import helpers
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
SMALL = ["--n-patches", "12", "--days", "15", "--dtype", "float32"]


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), *SMALL, *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def check_record(rec: dict, keys: list[str]) -> None:
    assert "error" not in rec, rec
    missing = [k for k in keys if k not in rec]
    assert not missing, (missing, rec)
    assert rec["dtype"] == "float32" and rec["n_patches"] == 12, rec
    for k in keys:
        if k.endswith("_s") or k.endswith("_mb"):
            assert rec[k] > 0, (k, rec)


@pytest.mark.slow
def test_forward_benchmark_writes_its_records(tmp_path):
    out = tmp_path / "forward.json"
    proc = run("forward.py", "--tools", "epifit", "--repeats", "2", "--json", str(out))
    records = json.loads(out.read_text())
    assert [r["config"] for r in records] == ["epifit", "epifit-bosh3"]
    keys = ["tool", "solver", "dtype", "n_patches", "fwd_compile_s", "fwd_s"]
    keys += ["peak_rss_mb", "steps"]
    for rec in records:
        check_record(rec, keys)
        assert rec["steps"] > 0 and rec["loss"] > 0
    assert [r["solver"] for r in records] == ["tsit5", "bosh3"]
    assert "epifit-bosh3" in proc.stdout  # the table


@pytest.mark.slow
def test_gradient_benchmark_rounds_agree_with_the_reference(tmp_path):
    """`--rounds 2` runs every configuration twice, in turn: each record
    names its round, carries the required fields and its error against the
    float64 reference (computed once, kept in `--ref-dir`), the ratios are
    taken against epifit's default of the same round, and the medians are
    printed after the rounds."""
    out = tmp_path / "gradient.json"
    proc = run(
        "gradient.py",
        *("--tools", "epifit", "--adjoints", "checkpoint", "--rounds", "2"),
        *("--repeats", "2", "--budget", "3", "--ref-dir", str(tmp_path)),
        *("--json", str(out)),
    )
    records = json.loads(out.read_text())
    assert [(r["config"], r["round"]) for r in records] == [
        ("epifit-checkpoint", 0),
        ("epifit-bosh3", 0),
        ("epifit-checkpoint", 1),
        ("epifit-bosh3", 1),
    ]
    keys = ["tool", "adjoint", "default", "dtype", "n_patches", "fwd_compile_s"]
    keys += ["fwd_s", "grad_compile_s", "grad_s", "peak_rss_mb", "grad_rel_err"]
    for rec in records:
        check_record(rec, keys)
        # float32 at rtol 1e-3 against the float64 reference (measured 8e-4
        # with Tsit5, 9e-3 with the third-order Bosh3); a gradient of the
        # wrong parameters or loss would be off by O(1)
        assert rec["grad_rel_err"] < (5e-3 if rec["default"] else 5e-2), rec
    assert [r["default"] for r in records] == [True, False, True, False]
    assert (tmp_path / "gradient_ref_12_15.npz").exists()
    for base, bosh in (records[:2], records[2:]):
        assert base["grad_vs_epifit"] == 1.0
        assert bosh["grad_vs_epifit"] == bosh["grad_s"] / base["grad_s"]
        assert bosh["fwd_vs_epifit"] == bosh["fwd_s"] / base["fwd_s"]
    assert "median over 2 rounds" in proc.stdout
    median = np.median([r["grad_s"] for r in records[1::2]])
    assert f"{median:.4f}" in proc.stdout.split("median over 2 rounds")[1]


# -- calibrate.py ----------------------------------------------------------------------
@pytest.mark.slow
def test_calibrate_benchmark_reports_a_failed_peer(tmp_path):
    """diffrax limited to 3 steps cannot solve the problem: its worker fails
    with diffrax's reason, epifit's still fits, the comparison still runs and
    every record carries the required fields."""
    out = tmp_path / "calibrate.json"
    proc = run(
        "calibrate.py",
        *("--tools", "epifit,diffrax", "--max-iter", "3", "--peer-max-steps", "3"),
        *("--json", str(out)),
    )
    *records, tail = json.loads(out.read_text())
    assert [r["config"] for r in records] == ["epifit", "diffrax-tsit5"]
    fields = ["config", "n_patches", "compile_s", "grad_compile_s", "wall_s"]
    fields += ["final_loss", "time_to_target_s", "time_to_result_s"]
    for rec in records:
        assert set(fields) <= set(rec), (set(fields) - set(rec), rec)
        assert rec["n_patches"] == 12 and rec["dtype"] == "float32"
    fit, failed = records
    assert "error" not in fit, fit
    assert fit["iterations"] == 3 and fit["final_loss"] < fit["initial_loss"]
    assert 0 < fit["grad_compile_s"] < fit["compile_s"]
    assert fit["time_to_result_s"] == pytest.approx(fit["compile_s"] + fit["wall_s"])
    # the target is epifit's own final loss, which it reaches within its run
    assert 0 < fit["time_to_target_s"] <= fit["wall_s"]
    assert "maximum number of solver steps" in failed["error"]
    assert failed["error"].startswith("non-finite loss at the start")
    assert failed["final_loss"] is None and failed["time_to_target_s"] is None
    assert failed["time_to_result_s"] is None and failed["grad_compile_s"] > 0
    summary = tail["summary"]["float32"]
    assert summary["failed"] == {"diffrax-tsit5": failed["error"]}
    assert summary["target_loss"] == fit["final_loss"]
    assert "diffrax-tsit5 FAILED: non-finite loss at the start" in proc.stdout


# -- cli.py ----------------------------------------------------------------------------
@pytest.mark.slow
def test_cli_benchmark_times_cold_and_warm_runs_of_one_fit(tmp_path):
    """`benchmarks/cli.py` on the boarding-school SIR (3 iterations): a cold
    and a warm `epifit calibrate` of the same fit (the same final loss as a
    calibrate in this process), the imports, the versions installed, and
    each target judged and printed (a 0 s target is never met)."""
    from importlib.metadata import version

    import epifit

    out = tmp_path / "cli.json"
    model = REPO / "models" / "sir.toml"
    data = REPO / "data" / "boarding_school_1978.nc"
    args = ["--model", str(model), "--data", str(data), "--max-iterations", "3"]
    args += ["--warm-runs", "1", "--imports", "1", "--cold-target", "0"]
    args += ["--warm-target", "1e9", "--json", str(out)]
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "cli.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (rec,) = json.loads(out.read_text())
    for key in ("cold_s", "warm_median_s", "import_jax_s", "import_epifit_s"):
        assert rec[key] > 0, (key, rec)
    assert len(rec["warm_s"]) == 1 and rec["max_iter"] == 3
    for package in ("jax", "jaxlib", "numpy", "ml_dtypes"):
        assert rec[package] == version(package), (package, rec)
    fit = epifit.calibrate(str(model), str(data), max_iterations=3, progress=False)
    assert rec["loss"] == pytest.approx(float(fit.loss), rel=1e-6)
    assert not rec["cold_met"] and rec["warm_met"]
    assert "(target 0 s: NOT met)" in proc.stdout
    assert "(target 1e+09 s: met)" in proc.stdout


def test_peer_loss_is_nan_where_the_solve_fails():
    """`throw=False`: a diffrax solve that runs out of steps gives a NaN loss
    (what epifit's objective gives), `throw=True` an error; with enough steps
    both give the same finite loss."""
    import jax
    import jax.numpy as jnp

    peers = helpers.import_benchmark("reference.peers")
    P = helpers.reference_problem().make_problem(4, 6, 0)
    args = peers.arguments(P, jnp.float64)

    def loss(**kw):
        return jax.jit(peers.build("diffrax-tsit5", args[3], args[4], **kw).loss)

    assert np.isnan(loss(max_steps=3, throw=False)(*args))
    with pytest.raises(Exception, match="maximum number of solver steps"):
        jax.block_until_ready(loss(max_steps=3, throw=True)(*args))
    value = loss(throw=False)(*args)
    assert np.isfinite(value) and value > 0
    assert value == loss(throw=True)(*args)


def _toy_fit(loss, x0, n: int):
    """`n` iterations at most of the benchmark optimiser on a toy loss."""
    import jax

    lbfgs = helpers.import_benchmark("_lbfgs")
    run, init = lbfgs.make_chunk(loss, ftol=0.0, gtol=1e-10, patience=5)
    f0, g0 = jax.value_and_grad(loss)(x0)
    carry, buf = jax.jit(run)(init(x0, f0, g0), (), n)
    return lbfgs, carry, [np.asarray(b) for b in buf]


def test_benchmark_optimizer_evaluates_its_start_in_the_chunk():
    """`init(x)` alone: the chunk's first trip evaluates the start (no step,
    no iteration), then the fit takes the iterates of a start evaluated
    beforehand, with one evaluation more; a start whose loss is not finite
    stops there."""
    import jax
    import jax.numpy as jnp

    def rosenbrock(x):
        return (1.0 - x[0]) ** 2 + 100.0 * (x[1] - x[0] ** 2) ** 2

    x0 = jnp.array([-1.2, 1.0])
    lbfgs, given, buf = _toy_fit(rosenbrock, x0, 15)
    run, init = lbfgs.make_chunk(rosenbrock, ftol=0.0, gtol=1e-10, patience=5)
    run = jax.jit(run)
    start, _ = run(init(x0), (), 0)
    assert int(start["it"]) == 0 and int(start["evals"]) == 1
    assert not bool(start["fresh"])
    assert float(start["f"]) == pytest.approx(float(rosenbrock(x0)), rel=1e-14)
    carry, own = run(start, (), 15)
    assert int(carry["it"]) == int(given["it"]) == 15
    assert int(carry["evals"]) == int(given["evals"]) + 1
    # the same iterates, to the rounding of a compiled against an eager start
    np.testing.assert_allclose(carry["x"], given["x"], rtol=1e-9)
    np.testing.assert_allclose(
        own[0], buf[0], rtol=1e-9
    )  # losses, iteration by iteration
    nan_start, _ = run(init(jnp.array([jnp.nan, 0.0])), (), 0)
    assert int(nan_start["status"]) == lbfgs.NONFINITE and int(nan_start["it"]) == 0


def test_benchmark_optimizer_rejects_non_finite_steps():
    """A loss that is finite only at the start: every line search meets only
    NaN, each step is rejected (the iterate stays), and the fit stops after
    `MAX_RETREATS` rejections in a row, as epifit's optimiser does."""
    import jax.numpy as jnp

    x0 = jnp.array([1.0, -2.0])

    def loss(x):
        return jnp.where(jnp.all(x == x0), jnp.sum(x**2), jnp.nan)

    lbfgs, carry, (losses, _, _, rejected) = _toy_fit(loss, x0, 50)
    n = lbfgs.MAX_RETREATS
    assert int(carry["status"]) == lbfgs.NONFINITE and int(carry["it"]) == n
    np.testing.assert_array_equal(carry["x"], x0)
    assert float(carry["f"]) == 5.0
    assert rejected[:n].tolist() == [1] * n and losses[:n].tolist() == [5.0] * n


def test_benchmark_optimizer_backs_off_from_failed_points():
    """A quadratic whose loss is NaN from x = 1.2 on (a solve that fails
    there), from (0.8, 0.9): the first trial point (a unit step along the
    normalised gradient, to about (1.69, 1.35)) fails, a retreat that keeps
    the iterate and halves the step, and the fit converges to the minimum at
    (1, 1), as `epifit.calibrate`'s L-BFGS does."""
    import jax
    import jax.numpy as jnp

    failed = []

    def loss(x):
        bad = ~jnp.all(x < 1.2)
        jax.debug.callback(lambda b: failed.append(bool(b)), bad)
        return jnp.where(bad, jnp.nan, jnp.sum((x - 1.0) ** 2))

    lbfgs, carry, (losses, _, _, rejected) = _toy_fit(loss, jnp.array([0.8, 0.9]), 50)
    jax.effects_barrier()
    assert failed[0] is False and failed[1] is True  # the start, then a failure
    assert int(carry["status"]) == lbfgs.GRADIENT, carry["status"]
    assert rejected[0] == 1 and losses[0] == pytest.approx(0.05)  # kept
    np.testing.assert_allclose(carry["x"], [1.0, 1.0], rtol=1e-9)


def test_benchmark_optimizer_takes_calibrates_iterates():
    """The benchmark's loop takes `epifit.calibrate`'s iterates: on the
    Rosenbrock function both reach the same points after the same number of
    iterations, with backtracking on the way (the same method, the loops'
    bookkeeping agrees; calibrate's loop is batched over starts, so its dot
    products round differently: 3e-12 relative after 20 iterations here)."""
    import jax
    import jax.numpy as jnp

    from epifit.fitting._config import PhaseConfig
    from epifit.fitting._optimize import OptimizeOptions, Optimizer

    def loss(x):
        return jnp.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2)

    x0 = jnp.array([-1.2, 1.0])
    n = 20
    _, carry, (losses, _, evals, _) = _toy_fit(loss, x0, n)

    class Fun:
        def value_and_grad(self, x, data):
            return jax.value_and_grad(loss)(x)

        def compiled(self, name):
            return jax.jit(jax.vmap(self.value_and_grad, in_axes=(0, None)))

    phase = PhaseConfig("lbfgs", n, options=(("memory_size", 10),))
    options = OptimizeOptions(tolerance=1e-10, loss_tolerance=0.0)
    out = Optimizer(Fun(), [phase], options).run(x0[None], {})
    assert int(carry["it"]) == n and out["record"]["iteration"] == n
    np.testing.assert_allclose(carry["x"], out["carry"].x[0], rtol=1e-9)
    np.testing.assert_allclose(
        losses[:n], out["record"]["history"]["loss"][0], rtol=1e-9
    )
    assert evals[:n].sum() > n  # backtracking trials were taken, within iterations


@pytest.mark.slow
def test_sample_benchmark_reports_every_tool_and_a_capped_peer(tmp_path):
    """`benchmarks/sample.py` on a tiny run: epifit's record has the ESS and
    cost figures; a peer past its cap is reported as stopped, not dropped;
    `--max-tree-depth` bounds every tool's trees (here about 5 gradients a
    draw at the default depth 10, at most 3 at depth 2)."""
    out = tmp_path / "sample.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "sample.py"),
            "--chains",
            "2",
            "--warmup",
            "30",
            "--draws",
            "30",
            "--tools",
            "epifit,epifit-forward,numpyro-odeint",
            "--max-tree-depth",
            "2",
            "--cap",
            "600",
            "--json",
            str(out),
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=1300,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = {r["tool"]: r for r in json.loads(out.read_text())}
    ours = records["epifit"]
    for key in ("sampling_s", "grads", "s_per_grad", "min_ess_bulk", "ess_per_s"):
        assert ours[key] > 0, (key, ours)
    assert ours["complete"] and ours["chains"] == 2
    assert set(ours["means"]) == {"beta", "gamma", "I0"}
    forward = records["epifit-forward"]  # forward sensitivities: the same run
    assert forward["complete"] and forward["s_per_grad"] > 0
    assert forward.get("ess_per_s_vs_fastest_peer", 0) > 0 or not peer_done(records)
    peer = records["numpyro-odeint"]
    assert peer.get("complete") or "stopped at its time cap" in peer.get("note", "")
    # all sample the same posterior: R0 = beta / gamma near the MAP's 3.9
    for r in (ours, forward, peer):
        if r.get("complete"):
            r0 = r["means"]["beta"] / r["means"]["gamma"]
            assert 3.0 < r0 < 5.0, r
            assert r["grads"] <= 2 * 30 * (2**2 - 1), r  # chains x draws x steps


def peer_done(records) -> bool:
    """Whether a peer's record has an ESS/s (epifit's ratio needs one)."""
    return any(
        r.get("ess_per_s", 0.0) > 0 for t, r in records.items() if "numpyro" in t
    )


def test_metapop_peers_log_density_is_epifits_log_posterior():
    """`benchmarks/sample.py --problem metapop`: the peers' hand-written log
    posterior (`_sample_metapop.log_density`, on diffrax and on `odeint`)
    is epifit's `LogDensity` under the same priors, at the data's true values
    (the point the synthetic data were drawn at, beside the MAP) and at a
    random point around them: the same function, not only the same MAP. At
    tight tolerances (the solvers' paths differ: epifit stops at the
    covariates' half-day jumps, the peers step over them); one evaluation
    each."""
    import jax
    import jax.numpy as jnp

    from epifit.fitting import Objective, parse_fit_config
    from epifit.fitting._parameters import FreeParameters
    from epifit.sampling._density import LogDensity
    from epifit.simulation import SolverSettings

    jax.config.update("jax_enable_x64", True)
    mp = helpers.import_benchmark("_sample_metapop")
    rtol, atol = 1e-10, 1e-13
    problem = mp.problem()
    free = FreeParameters(
        problem, problem.init_params(), parse_fit_config(mp.fit_config(rtol, atol))
    )
    assert len(free.labels) == 199
    settings = SolverSettings(rtol=rtol, atol=atol, max_steps=100_000)
    objective = Objective(problem, free, settings)
    epifit_logp = jax.jit(LogDensity(objective))
    A = mp.arrays()
    index = mp.reference_index(free.labels, A["patches"])
    p_true = mp.true_p(A["patches"])
    rng = np.random.default_rng(3)
    points = [p_true, p_true + rng.normal(0.0, 0.005, p_true.size)]
    want = [float(epifit_logp(jnp.asarray(p[index]), objective.data())) for p in points]
    # the permutation round-trips
    np.testing.assert_array_equal(
        mp.from_epifit(points[1][index], free.labels, A["patches"]), points[1]
    )
    for kind in ("diffrax", "odeint"):
        logp = jax.jit(mp.log_density(kind, A, rtol, atol, max_steps=200_000))
        got = [float(logp(jnp.asarray(p))) for p in points]
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=kind)
    # the two points differ by far more than the tolerance: not a constant
    assert abs(want[1] - want[0]) > 1e-3 * abs(want[0])


@pytest.mark.parametrize("fix", ["all", "hidden"])
def test_metapop_peers_conditional_log_density_is_epifits(fix):
    """`--fix-neural`: the peers' log density over the sampled coordinates
    (`on_sampled` of the density without the MLP's prior, or with it when
    the output layer is sampled) is epifit's `LogDensity` with the MLP's
    weights (or its hidden layers) fixed, at a point off the true values of
    what is sampled. One evaluation on `odeint` (the mapping is the same for
    both peers), at tolerances where the two solves agree to 1e-7 (at rtol
    1e-10 `odeint` is off by 2e-6 of the log density at the second point;
    the difference falls with the tolerance, a mapping error would not)."""
    import jax
    import jax.numpy as jnp

    from epifit.fitting import fit_config, resolve_fit
    from epifit.fitting._parameters import FreeParameters
    from epifit.sampling._density import LogDensity

    jax.config.update("jax_enable_x64", True)
    mp = helpers.import_benchmark("_sample_metapop")
    rtol, atol = 1e-12, 1e-15
    problem = mp.problem()
    A = mp.arrays()
    p_true = mp.true_p(A["patches"])
    params = helpers.params_from_flat(problem.model, p_true, problem.n_patches)
    config = fit_config(mp.fit_config(rtol, atol, fix_neural=fix))
    objective = resolve_fit(problem, config, init=params).objective
    labels = objective.free.labels
    weights = [s for s in labels if "beta" in s]
    if fix == "all":
        assert len(labels) == 23 and not weights
    else:  # the output layer: 7 weights and a bias
        assert len(labels) == 31 and len(weights) == 8
        assert all(s.startswith("beta.layers[3].") for s in weights)
    every = FreeParameters(problem, params).labels
    at = mp.reference_index(every, A["patches"])[[every.index(s) for s in labels]]
    q = p_true[at] + np.random.default_rng(4).normal(0.0, 0.005, len(labels))
    want = float(jax.jit(LogDensity(objective))(jnp.asarray(q), objective.data()))
    neural = fix != "all"
    logp = mp.on_sampled(mp.log_density("odeint", A, rtol, atol, neural=neural),
                         p_true, at)  # fmt: skip
    np.testing.assert_allclose(float(jax.jit(logp)(jnp.asarray(q))), want, rtol=1e-6)
    if fix == "all":  # the full density differs by the MLP's prior
        full = mp.log_density("odeint", A, rtol, atol)
        assert abs(float(jax.jit(full)(jnp.asarray(p_true))) - want) > 1.0
