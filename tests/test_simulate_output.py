"""`epifit simulate` and `epifit.simulate`: the trajectories file, its units and
provenance, one-line errors and atomic output.

The model is a pure decay `I -> R` at rate `gamma`, so `I(t) = I0 exp(-gamma t)`
is the reference answer."""

import json
import math
import os
import re

import numpy as np
import pandas as pd
import pytest
import xarray as xr

import epifit
from epifit.cli import main

DECAY = """\
name = "decay"
description = "I -> R at rate gamma: I(t) = I0 exp(-gamma t)."
compartments = ["I", "R"]

[parameters]
gamma = { value = 0.5, transform = "softplus", per_patch = true }
I0 = { value = 10.0, transform = "softplus" }

[derived]
half_life = "log(2) / gamma"

[[transitions]]
from = "I"
to = "R"
rate = "gamma"

[initial]
I = "I0"

[[observations]]
name = "cases"
kind = "prevalence"
compartments = ["I"]
"""

# the same model with its initial state from the data
DECAY_FROM_DATA = DECAY.replace(
    'I = "I0"', 'I = { data = "initial_I" }\nR = { data = "initial_R" }'
)

RTOL, ATOL = 1e-8, 1e-10
# the solve is at RTOL; the comparison with the closed form allows 100x that
CLOSED_FORM_RTOL = 100 * RTOL


@pytest.fixture(autouse=True)
def _no_persistent_cache(monkeypatch):
    """`main` would enable JAX's persistent compilation cache for the session."""
    monkeypatch.setenv("EPIFIT_NO_CACHE", "1")


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "decay.toml"
    path.write_text(DECAY)
    return path


def decay(i0, gamma, days):
    """`I0 exp(-gamma t)` on days `0 .. days - 1`, `(time, patch)`."""
    t = np.arange(days, dtype=float)[:, None]
    return i0 * np.exp(-np.outer(t, np.atleast_1d(gamma)))


def assert_values(attr: str, expected: dict) -> None:
    """The JSON attribute `attr` holds `expected`, to float64 rounding (the
    values pass through their unconstrained transforms)."""
    found = json.loads(attr)
    assert sorted(found) == sorted(expected)
    for k, v in expected.items():
        np.testing.assert_allclose(found[k], v, rtol=1e-12, err_msg=k)


def error_line(capsys) -> str:
    """The one line on stderr, checked to be an `epifit: error:` without a
    traceback."""
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("epifit: error: ")
    return lines[0]


# ---------------------------------------------------------------- the Dataset
def test_simulate_dims_units_and_provenance(model):
    ds = epifit.simulate(model, days=5, n_patches=2, rtol=RTOL, atol=ATOL)
    assert dict(ds.sizes) == {"time": 5, "state_row": 2, "patch": 2}
    assert ds["state"].dims == ("time", "state_row", "patch")
    assert ds["I"].dims == ds["predicted_cases"].dims == ("time", "patch")
    assert ds["time"].values.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert ds["time"].attrs == {"long_name": "day", "units": "days"}
    assert ds["patch"].values.tolist() == ["p0", "p1"]
    assert ds["state_row"].values.tolist() == ["I", "R"]
    np.testing.assert_allclose(
        ds["I"].values, decay(10.0, [0.5, 0.5], 5), rtol=CLOSED_FORM_RTOL
    )
    np.testing.assert_allclose(
        ds["R"].values, 10.0 - decay(10.0, [0.5, 0.5], 5), rtol=CLOSED_FORM_RTOL
    )
    # the model file declares no units: dimensionless, and the variable says so
    for name in ("state", "I", "R", "predicted_cases"):
        assert ds[name].attrs["units"] == "1", name
        assert "does not declare" in ds[name].attrs["units_comment"], name
        assert ds[name].attrs["long_name"], name
    assert_values(ds.attrs["parameters"], {"gamma": [0.5, 0.5], "I0": 10.0})
    assert_values(
        ds.attrs["derived_parameters"], {"half_life": [math.log(2) / 0.5] * 2}
    )
    assert ds.attrs["parameters_source"] == "the model's initial values"
    assert ds.attrs["params_file"] == ""
    assert ds.attrs["solver"] == "Tsit5"
    assert ds.attrs["stepsize_controller"] == "PIDController"
    assert (ds.attrs["rtol"], ds.attrs["atol"]) == (RTOL, ATOL)
    assert ds.attrs["model"] == "decay"
    assert ds.attrs["model_file"] == str(model)


def test_simulate_records_values_that_override_the_model(model):
    values = {"gamma": [0.2, 0.4], "I0": 3.0}
    ds = epifit.simulate(model, values=values, days=5, n_patches=2, rtol=RTOL)
    np.testing.assert_allclose(
        ds["I"].values, decay(3.0, [0.2, 0.4], 5), rtol=CLOSED_FORM_RTOL
    )
    assert_values(ds.attrs["parameters"], values)
    assert ds.attrs["parameters_source"] == (
        "the model's initial values, overridden by a mapping"
    )


def test_simulate_takes_solver_settings_and_records_them(model):
    from epifit.ode import ConstantStepSize
    from epifit.simulation import SolverSettings

    # RK4 at 0.01 days: global error ~ (gamma dt)^4 = 6e-10, far below 100 x RTOL
    fixed = SolverSettings(solver="rk4", stepsize_controller=ConstantStepSize(0.01))
    ds = epifit.simulate(model, days=5, n_patches=2, settings=fixed)
    np.testing.assert_allclose(
        ds["I"].values, decay(10.0, [0.5, 0.5], 5), rtol=CLOSED_FORM_RTOL
    )
    assert ds.attrs["solver"] == "RK4"
    assert ds.attrs["stepsize_controller"] == "ConstantStepSize"
    # the keywords replace the fields of the settings
    loose = SolverSettings(rtol=1e-3, atol=1e-3)
    ds = epifit.simulate(
        model,
        days=5,
        n_patches=2,
        settings=loose,
        rtol=RTOL,
        atol=ATOL,
        solver="dopri5",
    )
    np.testing.assert_allclose(
        ds["I"].values, decay(10.0, [0.5, 0.5], 5), rtol=CLOSED_FORM_RTOL
    )
    assert (ds.attrs["solver"], ds.attrs["rtol"], ds.attrs["atol"]) == (
        "Dopri5",
        RTOL,
        ATOL,
    )


def test_a_failed_solve_is_the_solvers_own_error(model):
    """The simulation's program solves without raising (`throw=False`); a
    failed solve is raised as the solver's own `SolverError`, with the
    segment and the cause."""
    from epifit.ode import SolverError
    from epifit.simulation import SolverSettings

    few = SolverSettings(rtol=1e-10, atol=1e-12, max_steps=2)
    with pytest.raises(SolverError, match=r"segment 0 .*steps per segment \(2\)"):
        epifit.simulate(model, days=3, n_patches=2, settings=few)


def test_units_come_from_the_data(tmp_path):
    model = tmp_path / "decay_data.toml"
    model.write_text(DECAY_FROM_DATA)
    dates = pd.date_range("2021-02-01", periods=4, freq="D")
    observed = np.array([[8.0, 1.0], [5.0, np.nan], [3.0, 0.0], [2.0, 0.0]])
    persons = {"units": "persons"}
    data = xr.Dataset(
        {
            "cases": (("time", "patch"), observed, {"long_name": "sick", **persons}),
            "initial_I": ("patch", [8.0, 1.0], persons),
            "initial_R": ("patch", [0.0, 0.0], persons),
        },
        coords={"time": dates, "patch": ["north", "south"]},
    )
    path = epifit.write_dataset(data, tmp_path / "data.nc")
    ds = epifit.simulate(model, path, rtol=RTOL, atol=ATOL)
    assert ds["patch"].values.tolist() == ["north", "south"]
    assert ds["time"].values.astype("datetime64[D]").astype(str).tolist() == [
        "2021-02-01",
        "2021-02-02",
        "2021-02-03",
        "2021-02-04",
    ]
    assert ds["time"].attrs == {"long_name": "date"}
    np.testing.assert_allclose(
        ds["I"].values, decay(np.array([8.0, 1.0]), 0.5, 4), rtol=CLOSED_FORM_RTOL
    )
    for name in ("state", "I", "R"):
        assert ds[name].attrs["units"] == "persons", name
        assert ds[name].attrs["units_comment"] == (
            "as the data's initial state (initial_I, initial_R)"
        )
    for name in ("predicted_cases", "observed_cases"):
        assert ds[name].attrs["units"] == "persons", name
        assert ds[name].attrs["units_comment"] == "as the data variable 'cases'"
    assert ds["observed_cases"].attrs["long_name"] == "observed: sick"
    np.testing.assert_array_equal(ds["observed_cases"].values, observed)
    assert ds.attrs["data_file"] == str(path)


# ------------------------------------------------------------------------- CLI
def test_cli_writes_a_file_that_round_trips(model, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # relative paths, recorded as given
    (tmp_path / "params.toml").write_text("gamma = [0.2, 0.4]\n")
    argv = ["simulate", "decay.toml", "--out", "out.nc", "--params", "params.toml"]
    argv += ["--days", "4", "--patches", "2", "--rtol", "1e-7", "--atol", "1e-10"]
    assert main(argv) == 0
    assert re.fullmatch(
        r"wrote out\.nc: model 'decay', 4 days x 2 patches, \d+ solver steps\n",
        capsys.readouterr().out,
    )
    with xr.open_dataset(tmp_path / "out.nc") as ds:
        ds = ds.load()
    assert ds.attrs["command"] == (
        "epifit --dtype float64 simulate decay.toml --out out.nc --params "
        "params.toml --days 4 --patches 2 --rtol 1e-07 --atol 1e-10"
    )
    assert dict(ds.sizes) == {"time": 4, "state_row": 2, "patch": 2}
    np.testing.assert_allclose(
        ds["I"].values, decay(10.0, [0.2, 0.4], 4), rtol=100 * 1e-7
    )
    assert ds["I"].attrs["units"] == "1"
    assert ds["time"].attrs["units"] == "days"
    assert ds["time"].dtype == np.float64  # "days" is not decoded to timedeltas
    assert_values(ds.attrs["parameters"], {"gamma": [0.2, 0.4], "I0": 10.0})
    assert ds.attrs["params_file"] == "params.toml"
    assert ds.attrs["parameters_source"] == (
        "the model's initial values, overridden from params.toml"
    )
    assert (ds.attrs["rtol"], ds.attrs["atol"], ds.attrs["solver"]) == (
        1e-7,
        1e-10,
        "Tsit5",
    )
    assert sorted(os.listdir(tmp_path)) == ["decay.toml", "out.nc", "params.toml"]


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing model", r"Model file \S*nomodel\.toml does not exist\."),
        ("malformed model", r"\S*bad\.toml: line 3: invalid TOML"),
        ("missing data", r"Data file \S*no\.nc does not exist\."),
        ("malformed data", r"Cannot read '\S*bad\.nc' as netCDF"),
        ("malformed params", r"\S*params\.toml: cannot parse parameters"),
        ("unknown params", r"\S*params\.toml: unknown parameters \['beta'\]"),
        (
            "missing directory",
            r"Cannot write \S*out\.nc: directory \S* does not exist\.",
        ),
    ],
)
def test_cli_errors_are_one_line(model, tmp_path, capsys, case, message):
    out = tmp_path / "out.nc"
    params = tmp_path / "params.toml"
    argv = ["simulate", str(model), "--out", str(out), "--days", "3"]
    if case == "missing model":
        argv[1] = str(tmp_path / "nomodel.toml")
    elif case == "malformed model":
        argv[1] = str(tmp_path / "bad.toml")
        (tmp_path / "bad.toml").write_text('name = "x"\ncompartments = ["I",\n[')
    elif case == "missing data":
        argv += ["--data", str(tmp_path / "no.nc")]
    elif case == "malformed data":
        (tmp_path / "bad.nc").write_text("not netCDF")
        argv += ["--data", str(tmp_path / "bad.nc")]
    elif case == "malformed params":
        params.write_text("gamma = \n")
        argv += ["--params", str(params)]
    elif case == "unknown params":
        params.write_text("beta = 1.0\n")
        argv += ["--params", str(params)]
    elif case == "missing directory":
        argv[3] = str(tmp_path / "nodir" / "out.nc")
    assert main(argv) == 2
    assert re.fullmatch(f"epifit: error: {message}.*", error_line(capsys))
    assert not out.exists()


# ------------------------------------------------------------------- atomicity
OLD = b"the previous output, not netCDF"


@pytest.mark.parametrize("existing", [False, True])
def test_failed_simulation_leaves_the_output_alone(model, tmp_path, capsys, existing):
    out = tmp_path / "out.nc"
    if existing:
        out.write_bytes(OLD)
    params = tmp_path / "params.toml"
    params.write_text("gamma = nan\n")  # the solve fails: the state is not finite
    before = sorted(os.listdir(tmp_path))
    argv = ["simulate", str(model), "--out", str(out), "--days", "3"]
    assert main([*argv, "--params", str(params)]) == 2
    assert "non-finite" in error_line(capsys)
    assert sorted(os.listdir(tmp_path)) == before
    assert out.read_bytes() == OLD if existing else not out.exists()


def test_failed_write_leaves_no_temporary_file(model, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out.nc"
    out.write_bytes(OLD)

    def half_write(self, path, *args, **kwargs):
        with open(path, "wb") as f:
            f.write(b"CDF\x01 partial")
        raise OSError("No space left on device")

    monkeypatch.setattr(xr.Dataset, "to_netcdf", half_write)
    argv = ["simulate", str(model), "--out", str(out), "--days", "3"]
    assert main(argv) == 2
    assert re.fullmatch(
        rf"epifit: error: Cannot write '{re.escape(str(out))}' as netCDF: "
        r"No space left on device",
        error_line(capsys),
    )
    assert sorted(os.listdir(tmp_path)) == ["decay.toml", "out.nc"]
    assert out.read_bytes() == OLD
