"""Scenario files and their Python twins: parsing, binding to a model, errors.

Binding happens before anything is compiled, so every error here is raised by
`forecast` itself in well under a second.
"""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

import epifit
from epifit.forecasting import (
    BASELINE,
    Change,
    Horizon,
    Scenario,
    ScenarioError,
    ScenarioSet,
    bind_scenarios,
    forecast,
    load_scenarios,
    parse_scenarios,
)
from epifit.simulation import Problem

REPO = Path(__file__).resolve().parents[1]
METAPOP = REPO / "models" / "seird_metapop_counts.toml"
SYNTHETIC = REPO / "data" / "synthetic_metapop_20.nc"
EXAMPLE = REPO / "models" / "scenarios_example.toml"
N_FIT = 90  # days of the synthetic data: 2020-03-01 .. 2020-05-29


@pytest.fixture(scope="module")
def problem():
    return Problem(METAPOP, SYNTHETIC)


def _bind(problem, scenarios, days=30):
    """Bind as `forecast` does (no solve)."""
    model = problem.model
    return bind_scenarios(
        scenarios,
        model=model,
        patches=problem.patches,
        covariates={k: np.asarray(v) for k, v in problem.covariates.items()},
        values={
            k: np.asarray(v) for k, v in model.constrain(problem.init_params()).items()
        },
        horizon=Horizon(N_FIT, N_FIT + days, np.datetime64("2020-03-01", "D")),
    )


def _write(tmp_path, text: str) -> Path:
    p = tmp_path / "scen.toml"
    p.write_text(text)
    return p


# ----------------------------------------------------------------- the format
def test_example_file_parses_and_matches_its_python_twin():
    sset = load_scenarios(EXAMPLE)
    assert sset.days == 60
    assert sset.names == ("distancing", "lockdown_p03", "travel_restrictions")
    twin = Scenario(
        "lockdown_p03",
        [
            Change(
                covariate="coupling",
                inflow=["p03"],
                outflow=["p03"],
                scale=0.0,
                start=dt.date(2020, 6, 1),
                end=dt.date(2020, 6, 29),
            ),
            Change(
                transmission=True,
                patches=["p03"],
                scale=0.8,
                start=dt.date(2020, 6, 1),
                end=dt.date(2020, 6, 29),
            ),
        ],
        "p03 closed for four weeks: no travel in or out, transmission -20 %",
    )
    assert sset.scenarios[1] == twin
    # the dict form (what to_dict writes) parses back to the same scenarios
    again = parse_scenarios(sset.to_dict())
    assert again.scenarios == sset.scenarios and again.days == sset.days


labels = st.sampled_from(["p00", "p03", "p07", "p19"])
changes = st.builds(
    Change,
    covariate=st.just("mobility"),
    scale=st.floats(0, 10, allow_nan=False),
    start=st.integers(0, 200) | st.dates(dt.date(2020, 1, 1), dt.date(2021, 1, 1)),
    patches=st.none() | st.lists(labels, min_size=1, max_size=4, unique=True),
    features=st.none()
    | st.lists(st.integers(0, 6), min_size=1, max_size=3, unique=True),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(changes, max_size=3))
def test_to_dict_round_trips(cs):
    s = ScenarioSet((Scenario("s", tuple(cs)),), days=3)
    assert parse_scenarios(s.to_dict()) == s


# -------------------------------------------------------------------- binding
def test_covariate_changes_become_arrays(problem):
    T = N_FIT + 30
    sset = ScenarioSet(
        (
            Scenario(
                "s",
                (
                    Change(
                        covariate="mobility", patches=["p01"], features=[2], scale=0.5
                    ),
                    Change(
                        covariate="coupling",
                        inflow=["p03"],
                        outflow=["p05"],
                        scale=0.0,
                        start=100,
                        end=110,
                    ),
                ),
            ),
        )
    )
    bound = _bind(problem, sset)
    assert bound.names == (BASELINE, "s")
    base, s = bound.data(0)["covariates"], bound.data(1)["covariates"]
    mob = np.asarray(problem.covariates["mobility"])
    # the baseline carries the last observed day forward
    assert base["mobility"].shape == (T, 20, 7)
    np.testing.assert_array_equal(base["mobility"][:N_FIT], mob)
    np.testing.assert_array_equal(base["mobility"][N_FIT:], np.repeat(mob[-1:], 30, 0))
    # mobility: only feature 2 of p01, from the first forecast day
    diff = s["mobility"] != base["mobility"]
    assert set(zip(*np.nonzero(diff.any(axis=0)), strict=True)) == {(1, 2)}
    assert np.flatnonzero(diff.any(axis=(1, 2))).tolist() == list(range(N_FIT, T))
    np.testing.assert_allclose(s["mobility"][N_FIT:, 1, 2], 0.5 * mob[-1, 1, 2])
    # coupling: row p03 and column p05 on days 100..109, nothing else
    c = s["coupling"]
    assert np.all(c[100:110, 3, :] == 0) and np.all(c[100:110, :, 5] == 0)
    keep = np.ones((20, 20), bool)
    keep[3, :] = keep[:, 5] = False
    np.testing.assert_array_equal(
        c[100:110][:, keep], base["coupling"][100:110][:, keep]
    )
    np.testing.assert_array_equal(c[:100], base["coupling"][:100])
    np.testing.assert_array_equal(c[110:], base["coupling"][110:])


def test_parameter_changes_cut_the_horizon_into_intervals(problem):
    sset = ScenarioSet(
        (
            Scenario("a", (Change(parameter="kappa", scale=0.5, start=95, end=100),)),
            Scenario(
                "b",
                (Change(parameter="scaler", patches=["p02"], value=3.0, start=105),),
            ),
        )
    )
    bound = _bind(problem, sset)
    assert bound.breaks == (95, 100, 105)
    assert bound.parameters == ("kappa", "scaler")
    assert bound.interval_of_day[[0, 94, 95, 99, 100, 104, 105, 119]].tolist() == [
        0, 0, 1, 1, 2, 2, 3, 3,
    ]  # fmt: skip
    a, b = bound.data(1)["parameters"], bound.data(2)["parameters"]
    np.testing.assert_array_equal(a["kappa"]["scale"], [1, 0.5, 1, 1])
    assert np.all(np.isnan(a["kappa"]["value"]))
    assert np.all(a["scaler"]["scale"] == 1) and np.all(np.isnan(a["scaler"]["value"]))
    v = b["scaler"]["value"]
    assert v.shape == (4, 20) and v[3, 2] == 3.0
    assert np.isnan(v[:3]).all() and np.isnan(np.delete(v[3], 2)).all()


def test_dates_and_days_mean_the_same(problem):
    by_day = Change(covariate="mobility", scale=0.5, start=95, end=100)
    by_date = Change(
        covariate="mobility", scale=0.5, start="2020-06-04", end=dt.date(2020, 6, 9)
    )
    a = _bind(problem, ScenarioSet((Scenario("s", (by_day,)),))).data(1)
    b = _bind(problem, ScenarioSet((Scenario("s", (by_date,)),))).data(1)
    np.testing.assert_array_equal(
        a["covariates"]["mobility"], b["covariates"]["mobility"]
    )


# --------------------------------------------------------------------- errors
BAD = [
    ("days = 3\n[scenarios.a\n", r"scen\.toml: line \d+: invalid TOML"),
    ("[scenario.a]\n", r"unknown field 'scenario'; expected one of: scenarios, days"),
    ("[scenarios]\n", r"scenarios: no scenarios defined"),
    (
        "[scenarios.a]\nchanges = [{ covariate = 'mobility', scael = 0.5 }]\n",
        r"scenarios\.a\.changes\[0\]\.scael: unknown field 'scael'; expected one of:",
    ),
    (
        "[scenarios.a]\nchanges = [{ scale = 0.5 }]\n",
        r"scenarios\.a\.changes\[0\]: give exactly one target: .* got none",
    ),
    (
        "[scenarios.a]\nchanges = [{ covariate = 'mobility', parameter = 'kappa', "
        "scale = 0.5 }]\n",
        r"give exactly one target: .* got covariate, parameter",
    ),
    (
        "[scenarios.a]\nchanges = [{ "
        "covariate = 'mobility', scale = 0.5, value = 1 }]\n",
        r"give exactly one of scale \(a factor\) or value \(a replacement\); got both",
    ),
    (
        "[scenarios.a]\nchanges = [{ covariate = 'mobility', scale = -1 }]\n",
        r"changes\[0\]\.scale: must be >= 0, got -1",
    ),
    (
        "[scenarios.a]\nchanges = [{ "
        "covariate = 'mobility', scale = 1, start = 'soon' }]\n",
        r"changes\[0\]\.start: cannot read 'soon' as a date; write YYYY-MM-DD",
    ),
    (
        "[scenarios.a]\nchanges = [{ "
        "parameter = 'kappa', scale = 1, inflow = ['p01'] }]\n",
        r"changes\[0\]\.inflow: 'inflow' applies to covariates only",
    ),
    (
        "[scenarios.baseline]\nchanges = [{ covariate = 'mobility', scale = 0.5 }]\n",
        r"scenarios\.baseline\.changes: 'baseline' is the carry-forward reference",
    ),
    # binding: names, labels, days
    (
        "[scenarios.a]\nchanges = [{ covariate = 'mobilty', scale = 0.5 }]\n",
        r"scen\.toml: scenarios\.a\.changes\[0\]\.covariate: unknown covariate "
        r"'mobilty'; the model's time-varying covariates: coupling, mobility",
    ),
    (
        "[scenarios.a]\nchanges = [{ covariate = 'population', scale = 0.5 }]\n",
        r"covariate 'population' \(dims patch\) does not vary in time",
    ),
    (
        "[scenarios.a]\nchanges = [{ parameter = 'kapa', scale = 0.5 }]\n",
        r"changes\[0\]\.parameter: unknown parameter 'kapa'; the model's parameters: "
        r"kappa, alpha, gamma, scaler",
    ),
    (
        "[scenarios.a]\nchanges = [{ parameter = 'eta', scale = 0.5 }]\n",
        r"'eta' is a derived quantity; change the parameters it is computed from",
    ),
    (
        "[scenarios.a]\nchanges = [{ parameter = 'beta', scale = 0.5 }]\n",
        r"'beta' is a neural sub-model; .* use transmission = true",
    ),
    (
        "[scenarios.a]\nchanges = [{ parameter = 'kappa', patches = ['p01'], "
        "scale = 0.5 }]\n",
        r"changes\[0\]\.patches: parameter 'kappa' is not per patch",
    ),
    (
        "[scenarios.a]\nchanges = [{ parameter = 'kappa', value = -1 }]\n",
        r"changes\[0\]\.value: value -1, outside the parameter's range \[0\.0, inf\]",
    ),
    (
        "[scenarios.a]\nchanges = [{ transmission = true, patches = ['p01', 'p99'], "
        "scale = 0.5 }]\n",
        r"changes\[0\]\.patches\[1\]: unknown patch 'p99'; the data's 20 patches: "
        r"p00, p01,",
    ),
    (
        "[scenarios.a]\nchanges = [{ covariate = 'mobility', inflow = ['p01'], "
        "scale = 0.5 }]\n",
        r"changes\[0\]\.inflow: covariate 'mobility' has dims "
        r"\(time, patch, feature\): no patch_to axis",
    ),
    (
        "[scenarios.a]\nchanges = [{ covariate = 'coupling', patches = ['p01'], "
        "scale = 0.5 }]\n",
        r"changes\[0\]\.patches: covariate 'coupling' couples patches: give inflow",
    ),
    (
        "[scenarios.a]\nchanges = [{ covariate = 'mobility', features = [7], "
        "scale = 0.5 }]\n",
        r"changes\[0\]\.features\[0\]: feature index 7 is out of range; covariate "
        r"'mobility' has 7 features \(0\.\.6\)",
    ),
    (
        "[scenarios.a]\nchanges = [{ covariate = 'mobility', scale = 0.5, "
        "start = 2020-12-01 }]\n",
        r"changes\[0\]\.start: start 2020-12-01 \(day 275\) is outside the horizon; "
        r"the horizon is 2020-03-01 \(day 0\) \.\. 2020-06-28 \(day 119\)",
    ),
    (
        "[scenarios.a]\nchanges = [{ covariate = 'mobility', scale = 0.5, "
        "start = 100, end = 100 }]\n",
        r"changes\[0\]\.end: end 2020-06-09 \(day 100\) must lie after the start",
    ),
    (
        "[scenarios.a]\nchanges = [{ "
        "covariate = 'mobility', scale = 0.5, end = 121 }]\n",
        r"changes\[0\]\.end: end .*\(day 121\) must lie after the start .* at most "
        r"one day past the horizon's last day",
    ),
    (
        "[scenarios.a]\nchanges = [\n"
        "  { covariate = 'mobility', scale = 0.7, start = 90 },\n"
        "  { covariate = 'mobility', patches = ['p03'], scale = 0.5, start = 100 },\n"
        "]\n",
        r"scenarios\.a\.changes\[1\]: changes\[0\] and changes\[1\] both change "
        r"covariate 'mobility' for some of the same entries on 2020-06-09 \(day 100\) "
        r"\.\. 2020-06-28 \(day 119\); overlapping changes are ambiguous",
    ),
    (
        "[scenarios.a]\nchanges = [\n"
        "  { covariate = 'coupling', inflow = ['p03'], scale = 0.0 },\n"
        "  { covariate = 'coupling', outflow = ['p05'], scale = 2.0 },\n"
        "]\n",
        r"changes\[0\] and changes\[1\] both change covariate 'coupling'",
    ),
]


@pytest.mark.parametrize(("text", "message"), BAD)
def test_bad_scenario_files_give_their_documented_errors(
    tmp_path, problem, text, message
):
    path = _write(tmp_path, text)
    with pytest.raises(ScenarioError, match=message) as info:
        forecast(problem, path, params=problem.init_params(), days=30, samples=0)
    assert info.value.file == str(path)


def test_disjoint_changes_of_one_covariate_are_fine(problem):
    sset = parse_scenarios(
        {
            "scenarios": {
                "a": {
                    "changes": [
                        {"covariate": "mobility", "scale": 0.7, "end": 100},
                        {"covariate": "mobility", "scale": 0.5, "start": 100},
                        {"covariate": "coupling", "inflow": ["p03"], "scale": 0.0},
                        {"covariate": "coupling", "inflow": ["p04"], "scale": 0.0},
                    ]
                }
            }
        }
    )
    bound = _bind(problem, sset)
    mob = bound.data(1)["covariates"]["mobility"]
    base = bound.data(0)["covariates"]["mobility"]
    np.testing.assert_allclose(mob[90:100], 0.7 * base[90:100])
    np.testing.assert_allclose(mob[100:], 0.5 * base[100:])


def test_python_scenarios_name_no_file_but_the_field():
    with pytest.raises(
        ScenarioError, match=r"^scenarios\.x\.changes\[0\]: give exactly one"
    ):
        Scenario("x", [Change(covariate="mobility")])
    # the target picks the kind of change, so a change without one fails at once,
    # before it has a place in a scenario
    with pytest.raises(ScenarioError, match=r"^give exactly one target: .* got none"):
        Change(scale=0.5)
    with pytest.raises(
        ScenarioError, match=r"scenarios\.x: scenario 'x' is defined twice"
    ):
        ScenarioSet((Scenario("x"), Scenario("x")))


def test_dates_need_dated_data(tmp_path):
    ds = epifit.open_dataset(SYNTHETIC)
    ds = ds.assign_coords(time=np.arange(ds.sizes["time"]))
    problem = Problem(METAPOP, ds)
    s = Scenario("s", [Change(covariate="mobility", scale=0.5, start="2020-06-01")])
    with pytest.raises(
        ScenarioError, match="the data have no dates .* give a day number"
    ):
        forecast(problem, s, params=problem.init_params(), days=5, samples=0)


def test_horizon_and_arguments_are_checked(problem):
    p = problem.init_params()
    with pytest.raises(
        ValueError, match=re.escape("Give the forecast horizon: days=N")
    ):
        forecast(problem, params=p, samples=0)
    with pytest.raises(ValueError, match="samples must be an integer >= 0"):
        forecast(problem, params=p, days=3, samples=-1)
    with pytest.raises(ValueError, match="quantiles must be increasing levels in"):
        forecast(problem, params=p, days=3, samples=0, quantiles=[0.5, 0.1])
    with pytest.raises(ValueError, match=r"Unknown compartment\(s\) \['Q'\]"):
        forecast(problem, params=p, days=3, samples=0, compartments=["Q"])
    with pytest.raises(ValueError, match="The fit has no covariance"):
        forecast(problem, params=p, days=3, samples=5)
    with pytest.raises(ValueError, match="covariance is not finite"):
        n = 3 + 20 + 176
        forecast(
            problem, params=p, days=3, samples=5, covariance=np.full((n, n), np.inf)
        )


def test_change_builds_the_final_class_of_its_target():
    from epifit.forecasting import (
        AbstractChange,
        CovariateChange,
        ParameterChange,
        TransmissionChange,
    )

    cov = Change(covariate="coupling", inflow=["p03"], scale=0.0, start=95)
    assert cov == CovariateChange("coupling", inflow=("p03",), scale=0.0, start=95)
    assert Change(parameter="kappa", value=1.0) == ParameterChange("kappa", value=1.0)
    assert Change(transmission=True, scale=0.5) == TransmissionChange(scale=0.5)
    assert isinstance(cov, AbstractChange)
    with pytest.raises(TypeError):
        AbstractChange(scale=1.0)
    # a covariate's fields on another target are refused when the change is made
    with pytest.raises(
        ScenarioError, match=r"^inflow: 'inflow' applies to covariates only; .*'kappa'"
    ):
        Change(parameter="kappa", scale=1.0, inflow=["p01"])
