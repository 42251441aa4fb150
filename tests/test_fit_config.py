"""Fit configurations: parsing, and errors that name the file and the field."""

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import epifit
from epifit.fitting import FitConfigError, load_fit_config, parse_fit_config
from epifit.fitting._config import PhaseConfig, parse_phases

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "models" / "sir.toml"
SEIR = REPO / "models" / "seir.toml"
DATA = REPO / "data" / "boarding_school_1978.nc"

GOOD = """
n_starts = 3
seed = 7
perturbation = 0.3
tolerance = 1e-9
time_budget = 60
adjoint = "backsolve"

[parameters]
I0 = { value = 1.0, fixed = true }
beta = { prior = { family = "normal", mean = 2.0, sd = 0.5 } }
gamma = { transform = "sigmoid", bounds = [0.0, 2.0], l2 = 0.1 }

[[phases]]
method = "adam"
iterations = 50
learning_rate = 0.05
schedule = "cosine"

[[phases]]
method = "lbfgs"
iterations = 100
memory_size = 5

[uncertainty]
method = "hessian"
level = 0.9
"""


def write(tmp_path, text: str, name: str = "fit.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_good_file(tmp_path):
    cfg = load_fit_config(write(tmp_path, GOOD))
    assert cfg.n_starts == 3 and cfg.seed == 7 and cfg.adjoint == "backsolve"
    assert cfg.phases[0] == PhaseConfig(
        "adam", 50, options=(("learning_rate", 0.05), ("schedule", "cosine"))
    )
    assert cfg.phases[1].option("memory_size") == 5
    assert cfg.parameters["I0"].fixed is True
    assert cfg.parameters["beta"].prior.family == "normal"
    assert cfg.parameters["gamma"].bounds == (0.0, 2.0)
    assert cfg.uncertainty == "hessian" and cfg.level == 0.9


def test_shipped_example_parses():
    cfg = load_fit_config(REPO / "models" / "sir_fit.toml")
    assert cfg.phases


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("n_startz = 3", r"fit\.toml: n_startz: unknown field 'n_startz'"),
        ("n_starts = 0", r"fit\.toml: n_starts: must be an integer >= 1"),
        ("n_starts = 1.5", r"fit\.toml: n_starts: expected an integer"),
        ("tolerance = -1", r"fit\.toml: tolerance: must be >= 0"),
        ('adjoint = "magic"', r"fit\.toml: adjoint: unknown value 'magic'"),
        ("[[phases]]\nmethod = 'bfgs'", r"fit\.toml: phases\[0\]\.method: unknown"),
        ("[[phases]]\niterations = 3", r"phases\[0\]\.method: missing required"),
        (
            "[[phases]]\nmethod = 'adam'\n[[phases]]\nmethod = 'lbfgs'\n"
            "learning_rate = 0.1",
            r"fit\.toml: phases\[1\]\.learning_rate: unknown field 'learning_rate'",
        ),
        (
            "[[phases]]\nmethod = 'adam'\nlearning_rate = -0.1",
            r"phases\[0\]\.learning_rate: must be > 0",
        ),
        (
            "[[phases]]\nmethod = 'adam'\nschedule = 'warmup_cosine'",
            r"phases\[0\]\.warmup_steps: schedule 'warmup_cosine' needs",
        ),
        (
            "[[phases]]\nmethod = 'rmsprop'\nmomentum = 1.5",
            r"phases\[0\]\.momentum: must lie in \[0, 1\)",
        ),
        (
            "[parameters]\nbeta = { prior = { family = 'normal', mean = 1 } }",
            r"parameters\.beta\.prior\.sd: missing required field 'sd'",
        ),
        (
            "[parameters]\nbeta = { prior = { family = 'cauchy' } }",
            r"parameters\.beta\.prior\.family: unknown value 'cauchy'",
        ),
        (
            "[parameters]\nbeta = { prior = { family = 'lognormal', median = -1, "
            "sdlog = 1 } }",
            r"parameters\.beta\.prior\.median: must be > 0",
        ),
        (
            "[parameters]\nbeta = { fixd = true }",
            r"parameters\.beta\.fixd: unknown field 'fixd'",
        ),
        (
            "[parameters]\nbeta = { transform = 'exp', bounds = [0, 1] }",
            r"parameters\.beta\.bounds: transform 'exp' maps onto",
        ),
        ("[uncertainty]\nlevel = 1.5", r"uncertainty\.level: must lie strictly"),
        ("n_starts = [", r"fit\.toml: line 1: invalid TOML"),
    ],
)
def test_bad_file_names_file_and_field(tmp_path, text, match):
    with pytest.raises(FitConfigError, match=match):
        load_fit_config(write(tmp_path, text))


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.toml does not exist"):
        load_fit_config(tmp_path / "nope.toml")


def test_dict_errors_name_fit():
    with pytest.raises(FitConfigError, match=r"^fit: seed: expected an integer"):
        parse_fit_config({"seed": "one"})


def test_python_phases():
    phases = parse_phases([{"method": "adam", "iterations": 5}, "lbfgs"])
    assert [p.method for p in phases] == ["adam", "lbfgs"]
    assert parse_phases("lm")[0].method == "levenberg_marquardt"
    with pytest.raises(
        FitConfigError, match=r"calibrate: optimizer\[0\]\.method: unknown"
    ):
        parse_phases("newton")


def test_python_phases_take_optax_transformations():
    import optax

    adam = optax.adam(1e-2)
    (phase,) = parse_phases(adam)
    assert (phase.method, phase.iterations) == ("optax", 200)
    assert phase.option("transform") is adam
    # a fit's settings and a checkpoint's fingerprint name its kind only
    assert phase.to_dict() == {
        "method": "optax",
        "iterations": 200,
        "transform": "optax.GradientTransformation",
    }
    first, second = parse_phases(
        [{"method": adam, "iterations": 30, "tolerance": 0.0}, "lbfgs"]
    )
    assert (first.method, first.iterations, first.tolerance) == ("optax", 30, 0.0)
    assert second.method == "lbfgs"
    with pytest.raises(
        FitConfigError, match=r"optimizer\[0\]\.learning_rate: unknown field"
    ):
        parse_phases([{"method": adam, "learning_rate": 0.1}])


# -- errors that need the model (raised before anything is compiled) --------------
@pytest.mark.parametrize(
    ("fit", "match"),
    [
        (
            {"parameters": {"delta": {"fixed": True}}},
            r"fit: parameters: unknown parameter\(s\) delta; model 'sir' has N, "
            "beta, gamma, I0",
        ),
        (
            {"parameters": {"beta": {"value": -1.0}}},
            r"fit: parameters\.beta\.value: value -1\.0 must lie strictly inside",
        ),
        (
            {"parameters": {"beta": {"transform": "sigmoid"}}},
            r"parameters\.beta\.transform: value 2\.0 must lie strictly inside "
            r"\(0\.0, 1\.0\).*; give a value",
        ),
        (
            {"parameters": {"beta": {"value": [1.0, 2.0]}}},
            r"parameters\.beta\.value: 'beta' is a scalar parameter",
        ),
    ],
)
def test_overrides_are_checked_against_the_model(fit, match):
    with pytest.raises(FitConfigError, match=match):
        epifit.calibrate(MODEL, DATA, fit=fit, progress=False)


def test_file_errors_name_the_file(tmp_path):
    path = write(tmp_path, "[parameters]\nbetta = { fixed = true }\n", "sir_fit.toml")
    with pytest.raises(FitConfigError, match=r"sir_fit\.toml: parameters: unknown"):
        epifit.calibrate(MODEL, DATA, fit=path, progress=False)


def test_everything_fixed(tmp_path):
    fit = {"parameters": {k: {"fixed": True} for k in ("beta", "gamma", "I0")}}
    with pytest.raises(FitConfigError, match="every parameter is fixed"):
        epifit.calibrate(MODEL, DATA, fit=fit, progress=False)


def test_least_squares_method_needs_gaussian_observations():
    import numpy as np
    import xarray as xr

    ds = xr.Dataset(
        {"cases": ("time", np.r_[np.nan, np.arange(1.0, 30.0)])},
        coords={"time": np.arange(30)},
    )
    with pytest.raises(NotImplementedError, match=r"'cases' poisson. Use lbfgs"):
        epifit.calibrate(SEIR, ds, optimizer="levenberg_marquardt", progress=False)


def test_lognormal_prior_rules_out_gauss_newton():
    fit = {
        "parameters": {
            "beta": {"prior": {"family": "lognormal", "median": 2.0, "sdlog": 0.5}}
        }
    }
    with pytest.raises(NotImplementedError, match="LogNormal prior on 'beta'"):
        epifit.calibrate(MODEL, DATA, fit=fit, optimizer="gauss_newton", progress=False)


@settings(max_examples=60, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(
            ["n_starts", "seed", "tolerance", "rtol", "adjoint", "phases", "bogus"]
        ),
        st.one_of(
            st.integers(-3, 5),
            st.floats(allow_nan=True),
            st.text(max_size=5),
            st.booleans(),
            st.lists(st.integers(), max_size=2),
        ),
        max_size=4,
    )
)
def test_parser_never_fails_uncontrolled(data):
    """Any dict is either accepted or refused with a FitConfigError."""
    try:
        parse_fit_config(data)
    except FitConfigError as e:
        assert str(e).startswith("fit: ")
