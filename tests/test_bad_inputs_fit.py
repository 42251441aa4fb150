"""Issue 18, the fitting part: bad inputs to `calibrate`, its results and
checkpoints end in one `epifit: error:` line (exit 2) that names what is at
fault, leave no output and leave the inputs byte-identical; a fit that
wanders uphill returns its best point and says so."""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import xarray as xr

import epifit
from epifit.cli import main
from epifit.data import DataError
from epifit.fitting import (
    CheckpointError,
    FitConfigError,
    FitResult,
    FreeParameters,
    Objective,
    check_fit_settings,
)
from epifit.fitting._uncertainty import interval_note, parameter_table

REPO = Path(__file__).resolve().parents[1]
SIR = (REPO / "models" / "sir.toml").read_text()
DATA = REPO / "data" / "boarding_school_1978.nc"


@pytest.fixture(autouse=True)
def _no_persistent_cache(monkeypatch):
    monkeypatch.setenv("EPIFIT_NO_CACHE", "1")


def _digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _dataset(edit=None) -> xr.Dataset:
    ds = xr.open_dataset(DATA).load()
    ds["in_bed"] = ds["in_bed"].astype(float)
    if edit is not None:
        edit(ds)
    return ds


def _nan_in_bed(ds):
    ds["in_bed"][:] = np.nan


def _huge_in_bed(ds):
    ds["in_bed"][3] = 1e300


SIR_RECOVERED = SIR + (
    '\n[[observations]]\nname = "recovered"\nkind = "prevalence"\n'
    'compartments = ["R"]\nfamily = "least_squares"\n'
)

# id, model text, dataset edit, fit file text, extra flags, message pattern
CALIBRATE_CASES = [
    (
        "observation-missing",
        SIR_RECOVERED,
        None,
        None,
        [],
        r"x\.nc: Model 'sir' \(sir\.toml\) observes 'recovered', which the dataset "
        r"lacks; found \['convalescent', 'in_bed', 'population'\]",
    ),
    (
        "every-observation-missing",
        (REPO / "models" / "seir.toml").read_text(),
        None,
        None,
        [],
        r"observes 'cases', which the dataset lacks; found \['convalescent'",
    ),
    (
        "observation-all-nan",
        SIR,
        _nan_in_bed,
        None,
        [],
        r"observed variable\(s\) 'in_bed' of model 'sir' hold no finite value",
    ),
    (
        "max-steps-5",
        SIR,
        None,
        "max_steps = 5\n",
        [],
        r"not finite at every starting point; at the first: the solve failed in "
        r"segment 0 at t = [0-9.]+: the solver reached max_steps = 5 steps per "
        r"segment; raise max_steps in the fit configuration",
    ),
    (
        "beta-1e6",
        SIR,
        None,
        "[parameters]\nbeta = { value = 1e6 }\n",
        [],
        r"not finite at every starting point; at the first: the solve failed .*"
        r"\(at beta = 1e\+06 \(the model file's: 2\)",
    ),
    (
        "observation-1e300",
        SIR,
        _huge_in_bed,
        None,
        [],
        # refused where the data are bound, before any solve (data layer)
        r"Observation 'in_bed' has 1 value\(s\) beyond 1e\+15 in magnitude, first "
        r"1e\+300 at time=1978-01-25",
    ),
    # (flags out of their form's range fail at parse time, naming the flag:
    # tests/test_bad_inputs_cli.py; the same settings as keywords:
    # test_keyword_settings_share_the_fit_file_checks below)
    (
        "n-starts-100000",
        SIR,
        None,
        None,
        ["--n-starts", "100000"],
        r"epifit calibrate: --n-starts: 100000 starting points are more than 10000",
    ),
    (
        "fit-file-n-starts-100000",
        SIR,
        None,
        "n_starts = 100000\n",
        [],
        r"fit\.toml: n_starts: 100000 starting points are more than 10000",
    ),
]


@pytest.mark.parametrize(
    "model, edit, fit, flags, pattern",
    [c[1:] for c in CALIBRATE_CASES],
    ids=[c[0] for c in CALIBRATE_CASES],
)
def test_calibrate_refuses(
    tmp_path, monkeypatch, capsys, model, edit, fit, flags, pattern
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sir.toml").write_text(model)
    _dataset(edit).to_netcdf(tmp_path / "x.nc")
    argv = ["calibrate", "sir.toml", "--data", "x.nc", "--out", "fit.nc"]
    if fit is not None:
        (tmp_path / "fit.toml").write_text(fit)
        argv += ["--fit", "fit.toml"]
    before = _digest(tmp_path)
    assert main([*argv, *flags, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("epifit: error: "), err
    assert re.search(pattern, err), err
    assert not (tmp_path / "fit.nc").exists()
    assert _digest(tmp_path) == before


def test_simulate_refuses_a_value_outside_the_transform(tmp_path, capsys):
    (tmp_path / "p.toml").write_text("beta = -1\n")
    before = _digest(tmp_path)
    out = tmp_path / "sim.nc"
    argv = ["simulate", str(REPO / "models" / "sir.toml"), "--data", str(DATA)]
    assert main([*argv, "--params", str(tmp_path / "p.toml"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert re.search(
        r"p\.toml: parameter 'beta' = -1 is out of its range: value -1\.0 must lie "
        r"strictly inside \(0\.0, inf\), the range of transform 'softplus'",
        err,
    ), err
    assert not out.exists() and _digest(tmp_path) == before


def test_calibrate_values_outside_the_range_are_refused():
    with pytest.raises(DataError, match=r"parameter 'gamma' = 0 is out of its range"):
        epifit.calibrate(
            REPO / "models" / "sir.toml", DATA, values={"gamma": 0.0}, progress=False
        )


@pytest.mark.parametrize(
    "values, pattern",
    [
        ({"max_iterations": -5}, r"calibrate: max_iterations: must be an integer >= 1"),
        ({"n_starts": 2.5}, r"n_starts: expected an integer, got float 2.5"),
        ({"perturbation": -0.1}, r"perturbation: must be >= 0, got -0.1"),
        ({"level": 1.5}, r"level: must lie strictly between 0 and 1"),
        ({"seed": -1}, r"seed: must be an integer >= 0, got -1"),
        ({"n_starts": 0}, r"n_starts: must be an integer >= 1, got 0"),
        ({"time_budget": float("nan")}, r"time_budget: expected a finite number"),
        ({"rtol": -1.0}, r"rtol: must be > 0, got -1"),
    ],
)
def test_keyword_settings_share_the_fit_file_checks(values, pattern):
    with pytest.raises(FitConfigError, match=pattern):
        check_fit_settings(values)
    with pytest.raises(FitConfigError, match=pattern):
        epifit.calibrate(REPO / "models" / "sir.toml", DATA, **values)


def test_check_fit_settings_names_flags():
    with pytest.raises(FitConfigError, match=r"^epifit: --max-iterations: must be"):
        check_fit_settings(
            {"max_iterations": 0},
            file="epifit",
            names={"max_iterations": "--max-iterations"},
        )
    assert check_fit_settings({"n_starts": np.int64(3), "rtol": None}) == {
        "n_starts": 3
    }


# -- a fit that goes uphill, its FIT.nc and its checkpoint ----------------------------
ADAM_20 = '[[phases]]\nmethod = "adam"\nlearning_rate = 20.0\n'


@pytest.fixture(scope="module")
def uphill(tmp_path_factory):
    """Adam with learning rate 20 from the model's start: the first step takes
    the loss from about 5505 to about 3e5, where the gradient is flat."""
    folder = tmp_path_factory.mktemp("uphill")
    run = folder / "run"
    run.mkdir()
    (run / "sir.toml").write_text(SIR)
    (run / "fit.toml").write_text(ADAM_20)
    shutil.copy(DATA, run / "x.nc")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EPIFIT_NO_CACHE", "1")
        mp.chdir(run)
        argv = ["calibrate", "sir.toml", "--data", "x.nc", "--fit", "fit.toml"]
        argv += ["--out", "fit.nc", "--checkpoint-every", "1", "--json"]
        argv += ["--no-progress"]
        code = main(argv)
    return code, run


def test_uphill_fit_returns_its_start_and_says_so(uphill, capsys):
    code, run = uphill
    assert code == 0
    fit = FitResult.from_netcdf(run / "fit.nc")
    assert not fit.converged
    m = re.search(
        r"stopped worse than the start \(loss ([0-9.e+]+) > ([0-9.e+]+) at the "
        r"start\); returned the best point seen \(iteration 0, loss ([0-9.e+]+)\)",
        fit.message,
    )
    assert m, fit.message
    last, start, best = (float(g) for g in m.groups())
    assert last > 10 * start and best == start
    assert fit.loss == pytest.approx(start, rel=1e-6)
    assert fit.loss == fit.initial_losses[0] < fit.loss_history[-1]
    # the start itself: the model file's values
    assert fit.parameters["beta"] == pytest.approx(2.0, rel=1e-12)
    assert fit.parameters["gamma"] == pytest.approx(0.5, rel=1e-12)
    assert "NOT converged" in fit.summary()


def test_fit_file_found_from_another_folder(uphill, tmp_path, monkeypatch):
    """The data path is stored relative to where the fit ran and absolute."""
    _, run = uphill
    monkeypatch.chdir(tmp_path)
    fit = FitResult.from_netcdf(run / "fit.nc")
    assert fit.problem is not None
    assert Path(fit.problem.data_path).resolve() == (run / "x.nc").resolve()


def _drop(name):
    return lambda ds: ds.drop_vars(name)


def _del_attr(name):
    def edit(ds):
        del ds.attrs[name]
        return ds

    return edit


def _set_attr(name, value):
    def edit(ds):
        ds.attrs[name] = value
        return ds

    return edit


def _edit_model(ds):
    ds.attrs["model_text"] = ds.attrs["model_text"].replace(
        'beta = { value = 2.0, transform = "softplus" }',
        'beta = { value = 2.0, transform = "exp" }',
    )
    return ds


FIT_CASES = [
    ("no-coefficients", _drop("coefficients"), r"no variable 'coefficients'"),
    ("no-covariance", _drop("covariance"), r"no variable 'covariance'"),
    ("no-loss", _del_attr("loss"), r"no attribute 'loss'"),
    ("iterations-negative", _set_attr("iterations", -9), r"'iterations' = -9"),
    ("settings-not-json", _set_attr("settings", "{oops"), r"'settings' is not JSON"),
    (
        "model-text-edited",
        _edit_model,
        r"the stored model text does not match its model_sha256",
    ),
]


@pytest.mark.parametrize(
    "edit, pattern", [c[1:] for c in FIT_CASES], ids=[c[0] for c in FIT_CASES]
)
def test_damaged_fit_file_is_refused(uphill, tmp_path, edit, pattern):
    _, run = uphill
    with xr.open_dataset(run / "fit.nc") as ds:
        bad = edit(ds.load().copy())
    path = tmp_path / "bad.nc"
    bad.to_netcdf(path)
    before = _digest(tmp_path)
    with pytest.raises(DataError, match=pattern) as e:
        FitResult.from_netcdf(path)
    assert "\n" not in str(e.value) and "bad.nc" in str(e.value)
    assert _digest(tmp_path) == before


def test_damaged_fit_file_forecast_is_one_line(uphill, tmp_path, capsys):
    _, run = uphill
    with xr.open_dataset(run / "fit.nc") as ds:
        bad = _edit_model(ds.load().copy())
    bad.to_netcdf(tmp_path / "bad.nc")
    before = _digest(tmp_path)
    out = tmp_path / "fc.nc"
    argv = ["forecast", str(tmp_path / "bad.nc"), "--out", str(out), "--days", "5"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert re.search(r"^epifit: error: .*does not match its model_sha256", err), err
    assert not out.exists() and _digest(tmp_path) == before


def _meta(edit):
    def change(z):
        meta = json.loads(str(z["meta"]))
        edit(meta)
        z["meta"] = np.asarray(json.dumps(meta))

    return change


def _drop_array(name):
    return lambda z: z.pop(name)


CHECKPOINT_CASES = [
    ("no-fingerprint", _meta(lambda m: m.pop("fingerprint")), r"lacks fingerprint"),
    (
        "iteration-negative",
        _meta(lambda m: m.update(iteration=-9)),
        r"'iteration' must be an integer >= 0, got -9",
    ),
    (
        "phase-negative",
        _meta(lambda m: m.update(phase=-1)),
        r"'phase' must be an integer >= 0, got -1",
    ),
    ("history-gone", _drop_array("hist_loss_0"), r"lacks the arrays hist_loss_0"),
    (
        "statuses-short",
        _meta(lambda m: m.update(statuses=[[]])),
        r"'statuses' must be lists of 1 status codes",
    ),
]


@pytest.mark.parametrize(
    "edit, pattern",
    [c[1:] for c in CHECKPOINT_CASES],
    ids=[c[0] for c in CHECKPOINT_CASES],
)
def test_damaged_checkpoint_is_refused(uphill, tmp_path, capsys, edit, pattern):
    _, run = uphill
    for name in ("sir.toml", "fit.toml", "x.nc"):
        shutil.copy(run / name, tmp_path / name)
    z = dict(np.load(run / "fit.ckpt"))
    edit(z)
    with open(tmp_path / "fit.ckpt", "wb") as fh:
        np.savez(fh, **z)
    before = _digest(tmp_path)
    argv = ["calibrate", str(tmp_path / "sir.toml"), "--data", str(tmp_path / "x.nc")]
    argv += ["--fit", str(tmp_path / "fit.toml"), "--out", str(tmp_path / "fit.nc")]
    assert main([*argv, "--resume", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("epifit: error: Checkpoint ") and "\n" not in err, err
    assert re.search(pattern, err), err
    assert not (tmp_path / "fit.nc").exists() and _digest(tmp_path) == before


def test_checkpoint_error_class():
    assert issubclass(CheckpointError, ValueError)


def test_overflowing_intervals_become_inf_with_a_note():
    """A derived value (R0 = beta / gamma) whose standard error dwarfs it: its
    log-scale interval overflows `exp` and becomes inf, with a note."""
    problem = epifit.Problem(REPO / "models" / "sir.toml", DATA)
    free = FreeParameters(problem, problem.init_params())
    objective = Objective(problem, free)
    x = np.asarray(free.x0)
    cov = np.diag(np.full(free.n, 1e6))
    rows = parameter_table(objective, x, objective.data(), cov)
    r0 = next(r for r in rows if r["label"] == "R0")
    assert math.isfinite(r0["estimate"]) and math.isfinite(r0["se"])
    assert r0["upper"] == math.inf
    assert re.search(r"the intervals of .*R0.* overflow", interval_note(rows))
