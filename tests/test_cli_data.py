"""`epifit data import`: CSV tables to netCDF through the CLI's `main`."""

import json

import numpy as np
import pytest

from epifit.cli import main
from epifit.data import open_dataset

LONG = """\
date,region,cases,deaths,note
2020-03-01,01001,3,0,a
2020-03-01,north,1,0,b
2020-03-02,01001,5,1,c
2020-03-04,north,7,,d
"""


@pytest.fixture(autouse=True)
def _no_persistent_cache(monkeypatch):
    """`main` would enable JAX's persistent compilation cache for the session."""
    monkeypatch.setenv("EPIFIT_NO_CACHE", "1")


def test_import_long_table_round_trip(tmp_path, capsys):
    table = tmp_path / "cases.csv"
    table.write_text(LONG)
    out = tmp_path / "cases.nc"
    argv = ["data", "import", str(table), "--out", str(out), "--patch", "region"]
    argv += ["--values", "cases,deaths", "--attr", "title=Cases by region"]
    argv += ["--attr", "comment=a=b"]
    assert main(argv) == 0
    assert capsys.readouterr().out.strip() == (
        f"wrote {out}: cases, deaths, 4 days x 2 patches"
    )
    ds = open_dataset(out)
    assert ds["cases"].dims == ("time", "patch")
    assert ds["patch"].values.tolist() == ["01001", "north"]  # the zero stays
    assert ds["time"].values.astype("datetime64[D]").astype(str).tolist() == [
        "2020-03-01",
        "2020-03-02",
        "2020-03-03",
        "2020-03-04",
    ]
    nan = np.nan
    np.testing.assert_array_equal(
        ds["cases"].values, [[3.0, 1.0], [5.0, nan], [nan, nan], [nan, 7.0]]
    )
    np.testing.assert_array_equal(
        ds["deaths"].values, [[0.0, 0.0], [1.0, nan], [nan, nan], [nan, nan]]
    )
    assert "note" not in ds
    assert ds.attrs == {
        "source": "cases.csv",
        "title": "Cases by region",
        "comment": "a=b",
    }


def test_import_wide_table_with_day_numbers(tmp_path, capsys):
    table = tmp_path / "school.csv"
    table.write_text("day,in_bed,convalescent\n0,3,0\n1,8,0\n3,76,0\n")
    out = tmp_path / "school.nc"
    argv = ["data", "import", str(table), "--out", str(out), "--time", "day"]
    assert main([*argv, "--no-fill-days", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary == {
        "out": str(out),
        "variables": ["in_bed", "convalescent"],
        "days": 3,
        "times": 3,
        "period": 1,
        "patches": None,
    }
    ds = open_dataset(out)
    assert ds["time"].values.tolist() == [0, 1, 3]
    assert ds["in_bed"].values.tolist() == [3.0, 8.0, 76.0]
    assert main(argv) == 0  # filled to every day by default
    assert open_dataset(out)["time"].values.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "csv, extra, message",
    [
        (
            "date,region,cases\n2020-03-01,north,x\n",
            ["--patch", "region"],
            "Cannot read 'x' in column 'cases' of '{table}' (row 2) as a number",
        ),
        (
            "date,region,cases\n2020-03-01,north,1\n2020-03-01,north,2\n",
            ["--patch", "region"],
            "Duplicate rows for {{'date': '2020-03-01', 'region': 'north'}}",
        ),
        (
            "date,cases\n2020-03-01,1\n",
            ["--values", "cases,deaths"],
            "No column 'deaths' in '{table}'; found ['date', 'cases']",
        ),
        (
            "when,cases\n2020-03-01,1\n",
            [],
            "No time column 'date' in '{table}'; found ['when', 'cases']",
        ),
        (
            "date,cases\n2020-03-01,1\n",
            ["--attr", "title"],
            "--attr 'title' is not KEY=VALUE",
        ),
        (
            "date,cases\n2020-03-01,1\n",
            ["--values", "cases,"],
            "--values 'cases,' has an empty column name",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, capsys, csv, extra, message):
    table = tmp_path / "bad.csv"
    table.write_text(csv)
    out = tmp_path / "bad.nc"
    code = main(["data", "import", str(table), "--out", str(out), *extra])
    assert code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err
    assert err.endswith("\n") and err.count("\n") == 1  # one line
    assert err.startswith("epifit: error: " + message.format(table=table))
    assert not out.exists()


def test_missing_table_and_missing_directory(tmp_path, capsys):
    missing = tmp_path / "nope.csv"
    assert main(["data", "import", str(missing), "--out", "x.nc"]) == 2
    assert (
        capsys.readouterr().err
        == f"epifit: error: CSV file {missing} does not exist.\n"
    )
    table = tmp_path / "ok.csv"
    table.write_text("date,cases\n2020-03-01,1\n")
    out = tmp_path / "no" / "such" / "dir.nc"
    assert main(["data", "import", str(table), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    # one message for a missing directory, that of epifit._paths.output_file
    assert err.startswith(f"epifit: error: Cannot write {out}: directory")
    assert err.count("\n") == 1


def test_data_needs_an_action(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["data"])
    assert exc.value.code == 2
    assert "required: ACTION" in capsys.readouterr().err
