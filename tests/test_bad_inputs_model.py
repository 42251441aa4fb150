"""Adversarial inputs of the model, expression, TOML and data layers (issue 18).

Each case builds its bad input in `tmp_path` from the bundled files, runs the
CLI through `epifit.cli.main` (or the library call), and checks the exit code
2, the one `epifit: error:` line, that no output file was left and that the
inputs are byte-identical afterwards. They all fail while reading the model or
binding the data, before any compilation.
"""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epifit.cli import main
from epifit.data import from_csv
from epifit.data._errors import DataError
from epifit.model import ModelSpecError, load_model, loads_model, parse_expression

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"
DATA = ROOT / "data"


def _edit(src: Path, dst: Path, old: str, new: str) -> Path:
    text = src.read_text()
    assert old in text, f"{old!r} not in {src.name}"
    dst.write_text(text.replace(old, new, 1))
    return dst


def _run(argv: list[str], inputs: list[Path], out: Path, capsys) -> str:
    """Run the CLI; exit 2, one error line, no output, inputs unchanged."""
    before = {p: p.read_bytes() for p in inputs}
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("epifit: error: "), err
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")]
    for p, raw in before.items():
        assert p.read_bytes() == raw, f"{p} changed"
    return lines[0]


# -- model files: (model, old text, new text, message) ----------------------------
MODEL_CASES = {
    "rate divided by zero": (
        "sir.toml",
        'rate = "gamma"',
        'rate = "gamma / 0"',
        r"x\.toml: transitions\[0\]\.rate: expression 'gamma / 0' is not finite: "
        r"'gamma / 0' divides by zero",
    ),
    "rate overflows": (
        "sir.toml",
        'rate = "gamma"',
        'rate = "gamma * exp(1000)"',
        r"transitions\[0\]\.rate: .*'exp\(1000\)' is inf",
    ),
    "log of zero from fixed values": (
        "sir.toml",
        'rate = "gamma"',
        'rate = "gamma + log(N - 763)"',
        r"transitions\[0\]\.rate: .*'log\(N - 763\)' is -inf",
    ),
    "power tower": (
        "sir.toml",
        'rate = "gamma"',
        'rate = "9**9**9**9"',
        r"transitions\[0\]\.rate: expression '9\*\*9\*\*9\*\*9' is not finite",
    ),
    "derived divides by zero": (
        "sir.toml",
        'R0 = "beta / gamma"',
        'R0 = "beta / (N - N)"',
        r"derived\.R0: .*divides by zero",
    ),
    "branch probability above 1": (
        "seird_boxcar.toml",
        'probability = "ifr" }',
        "probability = 1.5 }",
        r"transitions\[0\]\.branches\[0\]\.probability: a probability must be in "
        r"\[0, 1\], but got 1\.5",
    ),
    "probability parameter without a range": (
        "seird_boxcar.toml",
        'ifr = { value = 0.01, transform = "sigmoid" }',
        "ifr = { value = 0.01 }",
        r"branches\[0\]\.probability: .*parameter 'ifr' \(transform 'identity'\) "
        r'ranges over \[-inf, inf\] in a fit; give it transform = "sigmoid"',
    ),
    "probability parameter starting above 1": (
        "seird_boxcar.toml",
        'ifr = { value = 0.01, transform = "sigmoid" }',
        "ifr = { value = 1.2, fixed = true }",
        r"branches\[0\]\.probability: a probability must be in \[0, 1\], but 'ifr' "
        r"is 1\.2",
    ),
    "negative constant rate": (
        "sir.toml",
        'rate = "gamma"',
        'rate = "-0.5"',
        r"transitions\[0\]\.rate: a rate must be >= 0, but got -0\.5",
    ),
    "negative transmission": (
        "sir.toml",
        'transmission = "beta"',
        'transmission = "-beta"',
        r"infections\[0\]\.transmission: a transmission rate must be >= 0, but "
        r"'-beta' is -2\.0 at the parameters' initial values",
    ),
    "negative initial S": (
        "sir.toml",
        'S = "N - I0"',
        'S = "N - 1000"',
        r"initial\.S: an initial condition must be >= 0, but 'N - 1000' is -237\.0",
    ),
    "zero population": (
        "sir.toml",
        'population = "N"',
        'population = "N - 763"',
        r"infections\[0\]\.population: a population must be > 0",
    ),
    "negative rate parameter": (
        "sir.toml",
        'gamma = { value = 0.5, transform = "softplus" }',
        "gamma = { value = -0.5 }",
        r"transitions\[0\]\.rate: a rate must be >= 0, but 'gamma' is -0\.5 at the "
        r"parameters' initial values",
    ),
    "deeply nested TOML": (
        "sir.toml",
        'name = "sir"',
        'name = "sir"\nextra = ' + "[" * 5000 + "]" * 5000,
        r"x\.toml: invalid TOML: arrays or tables nested more than 32 deep",
    ),
    "moderately nested TOML": (
        "sir.toml",
        "N = { value = 763.0, fixed = true }",
        "N = { value = " + "[" * 200 + "1" + "]" * 200 + ", fixed = true }",
        r"x\.toml: parameters\.N\.value.*nested more than 32 deep",
    ),
}


@pytest.mark.parametrize("case", sorted(MODEL_CASES))
def test_bad_model_file(case, tmp_path, capsys):
    name, old, new, message = MODEL_CASES[case]
    model = _edit(MODELS / name, tmp_path / "x.toml", old, new)
    out = tmp_path / "out.nc"
    line = _run(
        ["simulate", str(model), "--days", "5", "--out", str(out)],
        [model],
        out,
        capsys,
    )
    assert re.search(message, line), line
    with pytest.raises(ModelSpecError, match=message):
        load_model(model)


def test_flat_sum_of_many_terms_is_not_nesting():
    """A left-associative chain is one level however long; nesting still counts."""
    terms = " + ".join(["a"] * 200)
    assert float(parse_expression(terms).evaluate({"a": 0.5})) == 100.0
    product = " * ".join(["a"] * 100) + " / a"
    value = float(parse_expression(product).evaluate({"a": 1.01}))
    assert math.isclose(value, 1.01**99)
    assert parse_expression(terms) == parse_expression(terms.replace(" ", ""))
    with pytest.raises(ModelSpecError, match="nested more than 64 deep"):
        parse_expression("a + (" * 70 + "a" + ")" * 70)
    horner = "a"  # (((a + a) * a + a) * a ...: the operators alternate, nested
    for i in range(70):
        horner = f"({horner} {'*' if i % 2 else '+'} a)"
    with pytest.raises(ModelSpecError, match="nested more than 64 deep"):
        parse_expression(horner)
    with pytest.raises(ModelSpecError, match="longer than 2000"):
        parse_expression("(" * 10_000 + "a" + ")" * 10_000)
    with pytest.raises(ModelSpecError, match="too many nested parentheses"):
        parse_expression("(" * 300 + "a" + ")" * 300)
    with pytest.raises(ModelSpecError, match="longer than"):
        parse_expression("a + " * 250_000 + "a")
    # a chain of 999 terms (the length limit's worth) evaluates without recursion
    long = "+".join(["a"] * 1000)
    assert float(parse_expression(long).evaluate({"a": 1.0})) == 1000.0


def test_flat_sum_in_a_model_file(tmp_path):
    text = (MODELS / "sir.toml").read_text()
    rate = " + ".join(["gamma / 65"] * 65)
    spec = loads_model(text.replace('rate = "gamma"', f'rate = "{rate}"'))
    assert spec.transitions[0].rate.names == {"gamma"}


@pytest.mark.parametrize(
    ("text", "value"),
    [("1 - 2 + 3", 2.0), ("8 / 2 / 2", 2.0), ("2 * 3 - 4 / 2", 4.0), ("2**3**2", 512)],
)
def test_chains_keep_their_meaning(text, value):
    assert float(parse_expression(text).evaluate({})) == value


def test_params_out_of_range(tmp_path, capsys):
    params = tmp_path / "p.toml"
    params.write_text("beta = -1\n")
    out = tmp_path / "out.nc"
    line = _run(
        ["simulate", str(MODELS / "sir.toml"), "--days", "5", "--params", str(params)]
        + ["--out", str(out)],
        [params],
        out,
        capsys,
    )
    want = (
        r"p\.toml: parameter 'beta' = -1 is out of its range: value -1\.0 must lie "
        r"strictly inside \(0\.0, inf\), the range of transform 'softplus'"
    )
    assert re.search(want, line), line


# -- data: (dataset editor, model, message) ---------------------------------------
def _huge_observation(ds):
    ds["in_bed"] = ds["in_bed"].astype(np.float64)
    ds["in_bed"][3] = 1e300
    return ds


def _huge_mobility(ds):
    ds["mobility"][5, 3, 1] = -1e300
    return ds


def _negative_coupling(ds):
    ds["coupling"][0, 1, 2] = -0.5
    return ds


DATA_CASES = {
    "observation of 1e300": (
        "boarding_school_1978.nc",
        _huge_observation,
        "sir.toml",
        r"Observation 'in_bed' has 1 value\(s\) beyond 1e\+15 in magnitude, first "
        r"1e\+300 at time=1978-01-25",
    ),
    "covariate of -1e300": (
        "synthetic_metapop_20.nc",
        _huge_mobility,
        "seird_metapop_mobility.toml",
        r"Covariate 'mobility' has 1 value\(s\) beyond 1e\+15 in magnitude, first "
        r"-1e\+300 at time=2020-03-06, patch='p03', feature=1",
    ),
    "negative coupling": (
        "synthetic_metapop_20.nc",
        _negative_coupling,
        "seird_metapop_mobility.toml",
        r"Covariate 'coupling' is a coupling matrix and must be >= 0; found 1 "
        r"negative value\(s\), first -0\.5 at time=2020-03-01, patch='p01', "
        r"patch_to='p02'",
    ),
}


@pytest.mark.parametrize("case", sorted(DATA_CASES))
def test_bad_dataset(case, tmp_path, capsys):
    source, edit, model, message = DATA_CASES[case]
    with xr.open_dataset(DATA / source) as ds:
        bad = edit(ds.load())
    data = tmp_path / "x.nc"
    bad.to_netcdf(data)
    out = tmp_path / "out.nc"
    line = _run(
        ["simulate", str(MODELS / model), "--data", str(data), "--out", str(out)],
        [data],
        out,
        capsys,
    )
    assert re.search(message, line), line


# -- CSV import ----------------------------------------------------------------------
CSV_CASES = {
    "time of day": (
        "date,cases\n2020-03-01,3\n2020-03-01T12:00,4\n2020-03-02,5\n",
        r"Date '2020-03-01T12:00' in column 'date' of '.*x\.csv' \(row 3\) has a "
        r"time of day; .*write the date alone \(YYYY-MM-DD\)",
    ),
    "time zone": (
        "date,cases\n2020-03-01T00:00+02:00,3\n2020-03-02T00:00+02:00,4\n",
        r"Column 'date' of '.*x\.csv' has dates with a time zone",
    ),
}


@pytest.mark.parametrize("case", sorted(CSV_CASES))
def test_bad_csv(case, tmp_path, capsys):
    text, message = CSV_CASES[case]
    table = tmp_path / "x.csv"
    table.write_text(text)
    out = tmp_path / "out.nc"
    line = _run(["data", "import", str(table), "--out", str(out)], [table], out, capsys)
    assert re.search(message, line), line
    with pytest.raises(DataError, match=message):
        from_csv(table)


def test_midnight_times_still_import(tmp_path):
    table = tmp_path / "x.csv"
    table.write_text("date,cases\n2020-03-01T00:00,3\n2020-03-02 00:00:00,4\n")
    ds = from_csv(table)
    assert ds["cases"].values.tolist() == [3.0, 4.0]


# -- property: one random field of a bundled model corrupted -----------------------
_FIELD = re.compile(r'^(\s*[\w.]+\s*=\s*)("[^"\n]*"|[-+\d.eE]+)', re.MULTILINE)
_REPLACEMENTS = st.sampled_from(
    [
        '"x / 0"',
        '"exp(1e4)"',
        '"-1"',
        "-1",
        "1.5",
        "0",
        "1e308",
        "\"__import__('os')\"",
        '"a.b"',
        "[[[[1]]]]",
        "{}",
        '""',
        "true",
        '"' + "+".join(["1"] * 100) + '"',
        '"' + "(" * 80 + "1" + ")" * 80 + '"',
    ]
)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    name=st.sampled_from(sorted(p.name for p in MODELS.glob("*.toml"))),
    pick=st.integers(0, 10_000),
    new=_REPLACEMENTS,
)
def test_corrupted_model_field_is_a_clean_error_or_a_model(name, pick, new, tmp_path):
    """Any bundled TOML with one value replaced either loads or raises one
    located `ModelSpecError` (or the scenario/fit readers' errors) naming the
    file; never another exception."""
    text = (MODELS / name).read_text()
    fields = list(_FIELD.finditer(text))
    if not fields:
        return
    m = fields[pick % len(fields)]
    bad = text[: m.start(2)] + new + text[m.end(2) :]
    path = tmp_path / name
    path.write_text(bad)
    if "compartments" not in bad:  # scenario and fit files: not model files
        return
    try:
        load_model(path)
    except ModelSpecError as e:
        assert str(e).startswith(str(path)), e
        assert "\n" not in str(e)
    shutil.rmtree(tmp_path, ignore_errors=True)
    tmp_path.mkdir()


# -- property: one random value of a bundled dataset corrupted ---------------------
_DATASETS = {
    "boarding_school_1978.nc": "sir.toml",
    "synthetic_metapop_20.nc": "seird_metapop_mobility.toml",
}
_LOADED: dict[str, xr.Dataset] = {}


def _dataset(name: str) -> xr.Dataset:
    if name not in _LOADED:
        with xr.open_dataset(DATA / name) as ds:
            _LOADED[name] = ds.load()
    return _LOADED[name].copy(deep=True)


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(sorted(_DATASETS)),
    var=st.integers(0, 100),
    index=st.integers(0, 10**6),
    value=st.sampled_from([np.nan, np.inf, -np.inf, -1.0, -1e-9, 1e300, 1e16, 0.0]),
)
def test_corrupted_data_value_is_a_clean_error_or_bound(name, var, index, value):
    """Any value of a bundled dataset replaced by a bad number either binds or
    raises one located error (a `ValueError` subclass, one line)."""
    from epifit.simulation import Problem

    ds = _dataset(name)
    names = sorted(str(v) for v in ds.data_vars)
    target = names[var % len(names)]
    values = ds[target].values.astype(np.float64)
    values.flat[index % values.size] = value
    ds[target] = ds[target].copy(data=values)
    try:
        Problem(MODELS / _DATASETS[name], ds)
    except ValueError as e:
        assert "\n" not in str(e), e
        assert type(e).__name__ in ("DataError", "ModelSpecError", "FitConfigError")


@pytest.mark.parametrize("depth", [40, 5000])
def test_deep_toml_names_the_file_in_every_reader(depth, tmp_path):
    """The located reader under model, fit and scenario files, and the values
    file of `--params`, refuse deep nesting naming the file."""
    from epifit._errors import LocatedError
    from epifit._toml import Reader, read_values_file

    text = "x = " + "[" * depth + "]" * depth + "\n"
    with pytest.raises(LocatedError, match=r"^fit\.toml: .*nested more than 32"):
        Reader("fit.toml").toml(text)
    values = tmp_path / "p.json"
    values.write_text("{" + '"a": {' * depth + "}" * depth + "}")
    if depth > 900:  # what Python's json module cannot parse without recursion

        def fail(reason):
            return ValueError(f"{values}: {reason}")

        with pytest.raises(ValueError, match=r"p\.json: arrays or tables nested"):
            read_values_file(values, fail)


# -- ranges at values given or fitted later (not known when the file loads) -------
def _difference_rate_model(tmp_path: Path) -> Path:
    """The SIR with `rate = "g1 - g2"` of two identity-transform parameters:
    valid at the file's values (0.5), negative where g2 > g1."""
    text = (MODELS / "sir.toml").read_text()
    text = text.replace(
        'gamma = { value = 0.5, transform = "softplus" }',
        "g1 = { value = 1.0 }\ng2 = { value = 0.5 }",
    )
    text = text.replace('R0 = "beta / gamma"', 'R0 = "beta / (g1 - g2)"')
    text = text.replace('rate = "gamma"', 'rate = "g1 - g2"')
    path = tmp_path / "diff.toml"
    path.write_text(text)
    return path


def test_range_violations_at_other_values(tmp_path):
    from epifit.model import compile_model

    model = compile_model(load_model(_difference_rate_model(tmp_path)))
    values = model.constrain(model.init_params(1))
    assert model.range_violations(values) == []
    values = {**values, "g2": np.float64(3.0)}
    assert model.range_violations(values) == [
        "transitions[0].rate: a rate must be >= 0, but 'g1 - g2' is -2.0"
    ]
    # NaN is left to the solve, which reports it
    assert model.range_violations({**values, "g2": np.float64(np.nan)}) == []


def test_params_that_break_a_rate_are_refused(tmp_path, capsys):
    model = _difference_rate_model(tmp_path)
    params = tmp_path / "p.toml"
    params.write_text("g2 = 3.0\n")
    out = tmp_path / "out.nc"
    line = _run(
        ["simulate", str(model), "--days", "5", "--params", str(params)]
        + ["--out", str(out)],
        [model, params],
        out,
        capsys,
    )
    want = (
        r"p\.toml: these values break the model: transitions\[0\]\.rate: a rate must "
        r"be >= 0, but 'g1 - g2' is -2\.0"
    )
    assert re.search(want, line), line


def test_a_fit_that_breaks_a_rate_says_so(tmp_path):
    import epifit

    model = _difference_rate_model(tmp_path)
    problem = epifit.Problem(model, DATA / "boarding_school_1978.nc")
    init = {**problem.init_params(), "g2": np.float64(1.25)}  # identity: as given
    fit = epifit.calibrate(
        problem,
        init=init,
        optimizer={"method": "adam", "iterations": 1, "learning_rate": 1e-6},
        uncertainty=False,
        progress=False,
    )
    assert not fit.converged
    assert re.search(
        r"the fitted values break the model: transitions\[0\]\.rate: a rate must be "
        r">= 0, but 'g1 - g2' is -0\.2499",
        fit.message,
    ), fit.message
