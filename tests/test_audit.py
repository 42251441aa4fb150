"""The adjoint audit: `audit_adjoints` and `epifit adjoints`.

One audit of every adjoint on the smallest bundled problem (SIR, the 1978
boarding-school outbreak: 14 days, one patch, 4 parameters), checked against a
loss and gradient computed here with scipy and central finite differences.
"""

import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import xarray as xr
from scipy.integrate import solve_ivp

import epifit.fitting
import epifit.fitting._audit as audit_module
from epifit.cli import main
from epifit.fitting import audit_adjoints
from epifit.fitting._audit import _recommend
from epifit.ode import CheckpointAdjoint
from epifit.simulation import ADJOINTS, Problem

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "models" / "sir.toml"
DATA = REPO / "data" / "boarding_school_1978.nc"
RTOL, ATOL = 1e-6, 1e-9  # audit_adjoints' defaults, the tolerances audited
# the reference is solved at rtol 1e-10; the finite differences below are good
# to ~1e-8 (truncation h^2 ~ 1e-10, solver noise 1e-13 * loss / h ~ 1e-8)
REFERENCE_RTOL = 1e-6
RECORD_FIELDS = ("loss", "compile_s", "eval_s", "xla_temp_output_mb", "rel_error")
with xr.open_dataset(DATA) as _ds:
    IN_BED = _ds["in_bed"].values.astype(float)  # pupils in bed, one a day


def _softplus(x):
    return np.log1p(np.exp(x))


def _sir_loss(u: dict) -> float:
    """models/sir.toml's least-squares loss on `in_bed`, written out: unconstrained
    `u` (softplus for beta, gamma, I0; N as is), solved by scipy's DOP853."""
    beta, gamma, i0 = (_softplus(u[k]) for k in ("beta", "gamma", "I0"))
    n = u["N"]

    def f(t, y):
        s, i = y
        return [-beta * s * i / n, beta * s * i / n - gamma * i]

    days = np.arange(IN_BED.size, dtype=float)
    sol = solve_ivp(
        f,
        (0.0, days[-1]),
        [n - i0, i0],
        t_eval=days,
        method="DOP853",
        rtol=1e-13,
        atol=1e-12,
    )
    assert sol.success
    return float(np.sum((sol.y[1] - IN_BED) ** 2))


def _fd_gradient(u: dict) -> dict:
    """Central finite differences of `_sir_loss`, one parameter at a time."""
    out = {}
    for k in u:
        h = 1e-5 * max(1.0, abs(u[k]))
        up, down = dict(u), dict(u)
        up[k] += h
        down[k] -= h
        out[k] = (_sir_loss(up) - _sir_loss(down)) / (2 * h)
    return out


@pytest.fixture(scope="module")
def problem():
    return Problem(MODEL, DATA)


@pytest.fixture(scope="module")
def start(problem):
    """The model's initial parameters, unconstrained, as floats."""
    return {k: float(v) for k, v in problem.init_params().items()}


@pytest.fixture(scope="module")
def audit(problem):
    return audit_adjoints(problem, repeats=1)


@pytest.fixture(autouse=True)
def _no_persistent_cache(monkeypatch):
    """`main` would enable JAX's persistent compilation cache for the session."""
    monkeypatch.setenv("EPIFIT_NO_CACHE", "1")


# ------------------------------------------------------------------ the library
def test_records_cover_every_adjoint(audit):
    assert [r["adjoint"] for r in audit.records] == list(ADJOINTS)
    for r in audit.records:
        assert "error" not in r, r
        assert r["n_params"] == 4 and isinstance(r["n_params"], int)
        assert r["finite"] is True
        for field in RECORD_FIELDS:
            assert type(r[field]) is float, (r["adjoint"], field)
            assert np.isfinite(r[field]), (r["adjoint"], field)
        assert r["compile_s"] > 0 and r["eval_s"] > 0
        # at least the loss and the 4 gradient entries are output buffers
        assert r["xla_temp_output_mb"] >= 5 * 8 / 2**20
    # the CLI writes the records as JSON: they must survive it unchanged
    assert json.loads(json.dumps(audit.records)) == audit.records


def test_reference_gradient_matches_finite_differences(audit, start):
    fd = _fd_gradient(start)
    assert set(audit.gradient) == set(fd)
    for k, g in fd.items():
        assert audit.gradient[k].dtype == np.float64
        assert float(audit.gradient[k]) == pytest.approx(g, rel=REFERENCE_RTOL), k
    # every adjoint's loss is the same solve at RTOL: the loss agrees to ~RTOL
    # (100x: the global error of an adaptive solve is a few times rtol)
    loss = _sir_loss(start)
    for r in audit.records:
        assert r["loss"] == pytest.approx(loss, rel=100 * RTOL), r["adjoint"]


def test_disagreements_are_small_and_real(audit):
    errors = {r["adjoint"]: r["rel_error"] for r in audit.records}
    # checkpoint is the exact gradient of a solution with global error of a few
    # rtol: its disagreement with the 1e4x tighter reference is O(rtol)...
    assert errors["checkpoint"] < 100 * RTOL
    # ... and not zero: the reference is a separate, tighter computation
    assert errors["checkpoint"] > 1e-4 * RTOL
    # continuous adjoints also integrate their own adjoint ODE at RTOL; 1e3 x
    # rtol bounds that on this smooth problem
    for name, e in errors.items():
        assert 0 < e < 1e3 * RTOL, name
    assert "rtol=1e-10" in audit.reference and "float64" in audit.reference


def test_recommendation_follows_the_documented_rule(audit):
    by_name = {r["adjoint"]: r for r in audit.records}
    limit = max(2 * by_name["checkpoint"]["rel_error"], 1e-3)
    within = [r for r in audit.records if r["rel_error"] <= limit]
    assert within  # checkpoint itself always is
    fastest = min(within, key=lambda r: r["eval_s"])
    assert audit.recommended == fastest["adjoint"]
    assert f"within {limit:.1e} of the reference" in audit.reason
    marked = [ln for ln in audit.table().splitlines() if "<- recommended" in ln]
    assert len(marked) == 1 and marked[0].startswith(audit.recommended + " ")


def _rec(name, rel_error, eval_s, finite=True):
    return {"adjoint": name, "rel_error": rel_error, "eval_s": eval_s, "finite": finite}


@pytest.mark.parametrize(
    ("records", "expected", "reason"),
    [
        # the fastest is too inaccurate: the next fastest within 1e-3 wins
        (
            [_rec("checkpoint", 1e-5, 1.0), _rec("a", 5e-3, 0.1), _rec("b", 1e-4, 0.5)],
            "b",
            "within 1.0e-03 of",
        ),
        # a checkpoint error above 5e-4 widens the limit to twice its error
        (
            [
                _rec("checkpoint", 2e-3, 1.0),
                _rec("a", 4.1e-3, 0.1),
                _rec("b", 3.9e-3, 0.2),
            ],
            "b",
            "within 4.0e-03 of",
        ),
        # skipped, failed and non-finite adjoints are never recommended
        (
            [
                _rec("checkpoint", 1e-5, 1.0),
                {"adjoint": "forward", "n_params": 9, "error": "skipped: ..."},
                _rec("nan", float("nan"), 0.01, finite=False),
                _rec("inf", 1e-6, 0.02, finite=False),
            ],
            "checkpoint",
            "within 1.0e-03 of",
        ),
        # none within the limit: the fastest finite one, and the reason says so
        (
            [_rec("a", 1e-2, 0.3), _rec("b", 2e-2, 0.2)],
            "b",
            "none is within 1.0e-03",
        ),
    ],
)
def test_recommend_rule(records, expected, reason):
    name, why = _recommend(records)
    assert name == expected
    assert reason in why


def test_recommend_needs_a_finite_gradient():
    records = [
        {"adjoint": "checkpoint", "n_params": 4, "error": "failed: SolverError"},
        _rec("backsolve", float("nan"), 0.1, finite=False),
    ]
    with pytest.raises(RuntimeError, match="No adjoint produced a finite gradient"):
        _recommend(records)


def test_float32_audit_has_a_float64_reference():
    with jax.enable_x64(False):
        problem32 = Problem(MODEL, DATA)
        assert problem32.dtype == jnp.float32
        # differentiated at the float32 parameters (rounding them moves the
        # gradient by ~3e-6 here)
        fd = _fd_gradient({k: float(v) for k, v in problem32.init_params().items()})
        audit32 = audit_adjoints(
            problem32, adjoints={"checkpoint": CheckpointAdjoint()}, repeats=1
        )
        # the session stays in float32
        assert jnp.zeros(()).dtype == jnp.float32
    # a float32 reference is off by ~1e-4 here; float64 agrees to ~1e-8
    for k, g in fd.items():
        assert audit32.gradient[k].dtype == np.float64
        assert float(audit32.gradient[k]) == pytest.approx(g, rel=REFERENCE_RTOL), k
    (rec,) = audit32.records
    # float32 rounding (eps 6e-8, amplified by the solve) shows, but stays small
    assert 0 < rec["rel_error"] < 1e-3
    assert audit32.recommended == "checkpoint"


def test_a_non_finite_reference_gradient_is_an_error(problem, monkeypatch):
    """When the reference gradient is NaN (the solves succeed but the loss's
    derivative does not exist there), no adjoint can be judged: the audit says
    so instead of recommending by NaN disagreements. (Non-finite parameters
    already stop the reference solve with a SolverError.)"""

    def nan_reference(problem, params, static, settings):
        return jax.tree.map(lambda x: np.full(np.shape(x), np.nan), params)

    monkeypatch.setattr(audit_module, "_reference_gradient", nan_reference)
    with pytest.raises(RuntimeError, match="reference gradient .* is not finite"):
        audit_adjoints(problem, adjoints={"checkpoint": CheckpointAdjoint()})


# ------------------------------------------------------------------ the CLI
def test_cli_prints_the_table_and_json(audit, monkeypatch, capsys, tmp_path):
    """`epifit adjoints` binds the files, passes its options on and prints the
    audit (the audit itself replaced by the one above: it is tested there)."""
    calls = []

    def spy(problem, params=None, **kwargs):
        calls.append((problem, params, kwargs))
        return audit

    monkeypatch.setattr(epifit.fitting, "audit_adjoints", spy)
    values = tmp_path / "values.toml"
    values.write_text("beta = 3.0\n")
    argv = ["adjoints", str(MODEL), "--data", str(DATA), "--params", str(values)]
    assert main([*argv, "--rtol", "1e-5", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    ((problem, params, kwargs),) = calls
    assert problem.spec.name == "sir" and problem.n_patches == 1
    assert problem.ts.size == 14
    assert kwargs == {"rtol": 1e-5, "atol": 1e-9, "repeats": 2}
    assert float(params["beta"]) == pytest.approx(np.log(np.expm1(3.0)), rel=1e-12)
    assert float(params["gamma"]) == pytest.approx(np.log(np.expm1(0.5)), rel=1e-12)

    lines = out.splitlines()
    assert re.match(
        r"adjoint\s+rel\. error\s+eval s\s+compile s\s+XLA temp\+out MB$", lines[0]
    )
    for name in ADJOINTS:
        (row,) = [ln for ln in lines if ln.startswith(name + " ")]
        assert ("<- recommended" in row) == (name == audit.recommended)
    assert f"recommended: {audit.recommended} ({audit.reason})" in lines

    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["records"] == audit.records
    assert data["recommended"] == audit.recommended
    assert data["reference"] == audit.reference


@pytest.mark.parametrize("missing", ["model", "data"])
def test_cli_missing_file_is_a_one_line_error(missing, capsys, tmp_path):
    model = tmp_path / "no.toml" if missing == "model" else MODEL
    data = tmp_path / "no.nc" if missing == "data" else DATA
    assert main(["adjoints", str(model), "--data", str(data)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "Traceback" not in captured.err
    assert len(captured.err.strip().splitlines()) == 1
    what = "Model" if missing == "model" else "Data"
    name = "no.toml" if missing == "model" else "no.nc"
    assert re.match(
        rf"epifit: error: {what} file .*{name} does not exist", captured.err
    )
