"""Issue 18, the CLI's part: outputs that would replace an input, unwritable
outputs, bad flags, `--json` on errors and non-finite numbers, size limits,
output locks, stale temporaries, atomic figures and full disks.

Each case builds its inputs in `tmp_path` from the bundled files, runs
`epifit.cli.main`, and checks exit code 2, one `epifit: error:` line (pinned by
a regex), no output file and no stray file left, and inputs byte-identical.
Most fail before anything is compiled."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import xarray as xr

from epifit._paths import (
    OutputError,
    atomic_write,
    lock_path,
    output_file,
    output_lock,
    remove_stale_temporaries,
)
from epifit.cli import main
from epifit.cli._json import dumps

REPO = Path(__file__).resolve().parents[1]
SIR = REPO / "models" / "sir.toml"
SIR_FIT = REPO / "models" / "sir_fit.toml"
SCENARIOS = REPO / "models" / "scenarios_example.toml"
DATA = REPO / "data" / "boarding_school_1978.nc"


@pytest.fixture(autouse=True)
def _no_persistent_cache(monkeypatch):
    monkeypatch.setenv("EPIFIT_NO_CACHE", "1")


def _strict(text: str):
    """`json.loads` that rejects `Infinity`, `-Infinity` and `NaN`."""

    def reject(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=reject)


@pytest.fixture
def work(tmp_path):
    """Copies of the bundled files in `tmp_path`, and a fake fit file that
    names the data copy in its attributes (as FIT.nc does)."""
    for src in (SIR, SIR_FIT, SCENARIOS):
        shutil.copy(src, tmp_path / src.name)
    shutil.copy(DATA, tmp_path / "x.nc")
    (tmp_path / "table.csv").write_text("date,cases\n2020-03-01,1\n2020-03-02,3\n")
    (tmp_path / "params.toml").write_text("beta = 1.5\n")
    fit = xr.Dataset({"loss": ((), 1.0)}, attrs={"data_file": str(tmp_path / "x.nc")})
    fit.to_netcdf(tmp_path / "FIT.nc")
    return tmp_path


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def _error_line(capsys) -> str:
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("epifit: error: ")
    return lines[0][len("epifit: error: ") :]


def _assert_fails(argv, capsys, folder: Path, message: str) -> str:
    """`main(argv)` exits 2 with one error line matching `message`, leaves
    every file of `folder` as it was and writes nothing."""
    before = _snapshot(folder)
    assert main(argv) == 2
    line = _error_line(capsys)
    assert re.search(message, line), line
    assert _snapshot(folder) == before
    return line


# -- 1. an output is never an input of the same command ------------------------------
SAME_FILE = [
    (
        "calibrate: --out is the dataset",
        ["calibrate", "{sir.toml}", "--data", "{x.nc}", "--out", "{x.nc}"],
        r"--out \S*x\.nc is the same file as --data \S*x\.nc, which this command "
        r"reads; write the output to another file\.",
    ),
    (
        "calibrate: --out is a hard link to the dataset",
        ["calibrate", "{sir.toml}", "--data", "{x.nc}", "--out", "{hard.nc}"],
        r"--out \S*hard\.nc is the same file as --data \S*x\.nc",
    ),
    (
        "calibrate: --data is a symbolic link to --out",
        ["calibrate", "{sir.toml}", "--data", "{link.nc}", "--out", "{x.nc}"],
        r"--out \S*x\.nc is the same file as --data \S*link\.nc",
    ),
    (
        "calibrate: --out is the model",
        ["calibrate", "{sir.toml}", "--data", "{x.nc}", "--out", "{sir.toml}"],
        r"--out \S*sir\.toml is the same file as the model \S*sir\.toml",
    ),
    (
        "calibrate: --out is the fit configuration",
        ["calibrate", "{sir.toml}", "--data", "{x.nc}", "--fit", "{sir_fit.toml}"]
        + ["--out", "{sir_fit.toml}"],
        r"--out \S*sir_fit\.toml is the same file as --fit \S*sir_fit\.toml",
    ),
    (
        "calibrate: --out is its own checkpoint",
        ["calibrate", "{sir.toml}", "--data", "{x.nc}", "--out", "{f.ckpt}"],
        r"--out \S*f\.ckpt and its checkpoint \S*f\.ckpt are the same file; give "
        r"--out another name \(e\.g\. \S*f\.nc\)",
    ),
    (
        "simulate: --out is the model",
        ["simulate", "{sir.toml}", "--days", "3", "--out", "{sir.toml}"],
        r"--out \S*sir\.toml is the same file as the model",
    ),
    (
        "simulate: --out is the parameter file",
        ["simulate", "{sir.toml}", "--days", "3", "--params", "{params.toml}"]
        + ["--out", "{params.toml}"],
        r"--out \S*params\.toml is the same file as --params",
    ),
    (
        "data import: --out is the table",
        ["data", "import", "{table.csv}", "--out", "{table.csv}"],
        r"--out \S*table\.csv is the same file as the table",
    ),
    (
        "plot: --out is the file plotted",
        ["plot", "{x.nc}", "--out", "{x.nc}"],
        r"--out \S*x\.nc is the same file as the input file",
    ),
    (
        "forecast: --out is the fit",
        ["forecast", "{FIT.nc}", "--days", "3", "--out", "{FIT.nc}"],
        r"--out \S*FIT\.nc is the same file as the input file",
    ),
    (
        "forecast: --out is the data the fit names",
        ["forecast", "{FIT.nc}", "--days", "3", "--out", "{x.nc}"],
        r"--out \S*x\.nc is the same file as the data file it names \(data_file\)",
    ),
    (
        "forecast: --out is the scenario file",
        ["forecast", "{FIT.nc}", "--scenarios", "{scenarios_example.toml}"]
        + ["--out", "{scenarios_example.toml}"],
        r"--out \S*scenarios_example\.toml is the same file as --scenarios",
    ),
]


def _argv(template: list[str], folder: Path) -> list[str]:
    return [
        str(folder / w[1:-1]) if w.startswith("{") and w.endswith("}") else w
        for w in template
    ]


@pytest.mark.parametrize(
    ("case", "argv", "message"), SAME_FILE, ids=[c[0] for c in SAME_FILE]
)
def test_an_output_is_never_an_input(work, capsys, case, argv, message):
    os.link(work / "x.nc", work / "hard.nc")
    (work / "link.nc").symlink_to(work / "x.nc")
    _assert_fails(_argv(argv, work), capsys, work, message)
    assert not (work / "f.ckpt").exists() and not (work / "f.nc").exists()


# -- 4. an unwritable --out fails before any work ------------------------------------
def test_unwritable_outputs_fail_before_any_work(work, capsys):
    fit = ["calibrate", str(work / "sir.toml"), "--data", str(work / "x.nc")]
    cases = [
        (work, r"Cannot write --out \S+: it is a directory; give a file name"),
        (
            work / "no" / "f.nc",
            r"Cannot write \S*no/f\.nc: directory \S*no does not exist\.",
        ),
        (
            Path("/proc/epifit-test/f.nc"),
            r"Cannot write \S*f\.nc: directory /proc/epifit-test does not exist",
        ),
        (
            Path("/proc/f.nc"),
            r"Cannot write --out /proc/f\.nc: cannot create files in directory "
            r"/proc \(.*\(E[A-Z]+\)\)\.",
        ),
    ]
    for out, message in cases:
        _assert_fails([*fit, "--out", str(out)], capsys, work, message)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_directory(work, capsys):
    ro = work / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        argv = ["data", "import", str(work / "table.csv"), "--out", str(ro / "d.nc")]
        _assert_fails(
            argv, capsys, work, r"cannot create files in directory .*\(EACCES\)"
        )
    finally:
        ro.chmod(0o755)


# -- 9. every numeric flag is checked at parse time, naming the flag -----------------
FLAGS = [
    (
        ["calibrate", "--max-iterations", "-5"],
        r"^--max-iterations must be >= 1; got -5$",
    ),
    (["calibrate", "--n-starts", "0"], r"^--n-starts must be >= 1; got 0$"),
    (["calibrate", "--time-budget", "nan"], r"^--time-budget must be a finite number"),
    (["calibrate", "--time-budget", "0"], r"^--time-budget must be > 0; got 0$"),
    (["calibrate", "--rtol", "-1"], r"^--rtol must be > 0; got -1$"),
    (["calibrate", "--atol", "inf"], r"^--atol must be a finite number; got inf$"),
    (["calibrate", "--seed", "-1"], r"^--seed must be >= 0; got -1$"),
    (["calibrate", "--checkpoint-every", "x"], r"^--checkpoint-every must be an int"),
    (["simulate", "--patches", "0"], r"^--patches must be >= 1; got 0$"),
    (["simulate", "--days", "-3"], r"^--days must be >= 1; got -3$"),
    (["simulate", "--rtol", "-1"], r"^--rtol must be > 0; got -1$"),
    (["forecast", "--samples", "-1"], r"^--samples must be >= 0; got -1$"),
    (["forecast", "--days", "1.5"], r"^--days must be an integer >= 0; got '1\.5'$"),
    (["forecast", "--chunk-size", "0"], r"^--chunk-size must be >= 1; got 0$"),
    (["forecast", "--quantiles", "0.5,2"], r"^--quantiles must be comma-separated "),
    (["plot", "--max-patches", "0"], r"^--max-patches must be >= 1; got 0$"),
    (["plot", "--samples", "-1"], r"^--samples must be >= 0; got -1$"),
    (["adjoints", "--repeats", "0"], r"^--repeats must be >= 1; got 0$"),
]
_POSITIONAL = {
    "calibrate": ["{sir.toml}", "--data", "{x.nc}", "--out", "{f.nc}"],
    "simulate": ["{sir.toml}", "--out", "{f.nc}"],
    "forecast": ["{FIT.nc}", "--out", "{f.nc}"],
    "plot": ["{x.nc}", "--out", "{f.png}"],
    "adjoints": ["{sir.toml}", "--data", "{x.nc}"],
}


@pytest.mark.parametrize(
    ("argv", "message"), FLAGS, ids=[" ".join(f[0]) for f in FLAGS]
)
def test_flags_are_checked_at_parse_time(work, capsys, argv, message):
    command, *flag = argv
    full = _argv([command, *_POSITIONAL[command], *flag], work)
    _assert_fails(full, capsys, work, message)
    # and with --json, one JSON object with the same message
    assert main([*full, "--json"]) == 2
    captured = capsys.readouterr()
    assert _strict(captured.out) == {"error": captured.err.strip()[15:]}


def test_usage_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["simulate"])
    assert exc.value.code == 2
    line = _error_line(capsys)
    assert re.fullmatch(
        r"the following arguments are required: model, --out \(see `epifit "
        r"simulate --help`\)",
        line,
    )


# -- 3. errors and successes with --json, non-finite numbers -------------------------
def test_json_error_is_one_object_on_stdout(work, capsys):
    argv = ["calibrate", str(work / "sir.toml"), "--data", str(work / "x.nc")]
    assert main([*argv, "--out", str(work / "x.nc"), "--json"]) == 2
    captured = capsys.readouterr()
    record = _strict(captured.out)
    assert list(record) == ["error"]
    assert (
        record["error"].startswith("--out ") and "is the same file" in record["error"]
    )
    assert captured.err == f"epifit: error: {record['error']}\n"


def test_json_is_standard_with_non_finite_numbers_as_null():
    text = dumps(
        {
            "loss": float("inf"),
            "start_losses": [1.0, float("nan"), np.float64(-np.inf)],
            "n": np.int64(3),
            "ok": np.bool_(True),
            "x": np.array([1.5, 2.5]),
        }
    )
    record = _strict(text)
    assert record["loss"] is None and record["start_losses"] == [1.0, None, None]
    assert record["n"] == 3 and record["ok"] is True and record["x"] == [1.5, 2.5]
    assert record["non_finite"] == [
        "loss (inf)",
        "start_losses[1] (nan)",
        "start_losses[2] (-inf)",
    ]
    assert record["note"] == (
        "non-finite numbers written as null: loss (inf), start_losses[1] (nan), "
        "start_losses[2] (-inf)"
    )
    assert "non_finite" not in _strict(dumps({"loss": 1.0}))


@pytest.mark.parametrize(
    ("error", "message"),
    [
        (FloatingPointError("invalid value in exp"), r"^non-finite number: invalid "),
        (OverflowError("math range error"), r"^overflow: math range error \(rerun "),
        (ZeroDivisionError("float division by zero"), r"^division by zero: float "),
        (MemoryError(), r"^out of memory; give fewer days, samples or starts$"),
    ],
)
def test_arithmetic_errors_are_one_line(work, capsys, monkeypatch, error, message):
    import epifit.simulation

    def boom(*args, **kwargs):
        raise error

    monkeypatch.setattr(epifit.simulation, "simulate", boom)
    argv = ["simulate", str(work / "sir.toml"), "--days", "3", "--out"]
    _assert_fails([*argv, str(work / "s.nc"), "--json"], capsys, work, message)


# -- 8. sizes are checked against memory before anything is allocated ----------------
def test_simulate_horizon_is_checked_against_memory(work, capsys, monkeypatch):
    monkeypatch.setenv("EPIFIT_MEMORY_LIMIT", str(10**9))
    argv = ["simulate", str(work / "sir.toml"), "--days", "100000000"]
    _assert_fails(
        [*argv, "--out", str(work / "s.nc")],
        capsys,
        work,
        r"^days = 100000000 needs about 19 GB for the trajectories \(3 states x 1 "
        r"patches x 1e\+08 days x 8 bytes x 8 copies\); at most 1\.0 GB on this "
        r"machine .*; give fewer days \(--days\)\.$",
    )


def test_forecast_horizon_is_checked_against_memory(monkeypatch):
    from epifit._memory import SizeError
    from epifit.forecasting import prepare_forecast
    from epifit.simulation import Problem

    monkeypatch.setenv("EPIFIT_MEMORY_LIMIT", str(10**9))
    problem = Problem(SIR, DATA)
    with pytest.raises(
        SizeError,
        # 2 series: the observation and R_eff(t)
        match=r"^days = 100000000 with 100 samples needs about 330 GB for 1e\+08 "
        r"days x \(2 x 101 draws x 2 series x 1 patches \+ 3 x 3 states\) x 8 "
        r"bytes; at most 1\.0 GB on this machine .*give fewer days \(--days\) or "
        r"samples \(--samples\)\.$",
    ):
        prepare_forecast(problem, days=10**8, samples=100)


# -- 10. locks, stale temporaries, atomic figures, full disks ------------------------
def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_second_writer_of_the_same_output_fails(work, capsys):
    out = work / "d.nc"
    argv = ["data", "import", str(work / "table.csv"), "--out", str(out)]
    with output_lock(out):
        _assert_fails(
            argv,
            capsys,
            work,
            rf"^--out \S*d\.nc is being written by another epifit process \(PID "
            rf"{os.getpid()}, lock \S*d\.nc\.lock\); wait for it to finish or choose "
            r"another --out\.$",
        )
    assert not lock_path(out).exists()
    # a lock left by a killed run (its PID is gone) is removed
    lock_path(out).write_text(f"{_dead_pid()}\n")
    assert main(argv) == 0
    assert out.exists() and not lock_path(out).exists()


def test_stale_temporaries_of_dead_writers_are_removed(tmp_path):
    target = tmp_path / "d.nc"
    dead = tmp_path / f".d.nc.{_dead_pid()}.0123abcd.tmp"
    live = tmp_path / f".d.nc.{os.getpid()}.4567cdef.tmp"
    other = tmp_path / f".e.nc.{_dead_pid()}.0123abcd.tmp"
    for p in (dead, live, other):
        p.write_bytes(b"half")
    from epifit.data import write_dataset

    write_dataset(xr.Dataset({"x": ("time", [1.0])}), target)
    assert not dead.exists() and live.exists() and other.exists()
    assert remove_stale_temporaries(tmp_path / "e.nc") == [other]


def test_figures_are_written_atomically(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    from epifit.plotting import plot_fit

    ds = xr.Dataset(
        {"predicted_cases": (("time", "patch"), np.arange(6.0).reshape(3, 2))},
        coords={"time": [0, 1, 2], "patch": ["a", "b"]},
    )
    out = tmp_path / "fig.png"
    plot_fit(ds, out)
    before = out.read_bytes()
    assert before[:8] == b"\x89PNG\r\n\x1a\n"

    def half(self, path, *args, **kwargs):
        Path(path).write_bytes(b"\x89PNG half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", half)
    with pytest.raises(OSError):
        plot_fit(ds, out)
    assert out.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["fig.png"]
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"figures are written as .*png.*'\.xyz'"):
        plot_fit(ds, tmp_path / "fig.xyz")
    assert sorted(os.listdir(tmp_path)) == ["fig.png"]


@pytest.mark.parametrize(
    ("error", "free", "message"),
    [
        (
            OSError(errno.ENOSPC, "No space left on device"),
            None,
            r"^Cannot write '\S*d\.nc' as netCDF: no space left on device "
            r"\(ENOSPC\)$",
        ),
        (
            RuntimeError("NetCDF: HDF error"),
            0,
            r"^Cannot write '\S*d\.nc' as netCDF: no space left on device \(ENOSPC\)"
            r": 0\.0 MB free in '\S+', the dataset needs about 0\.0 MB$",
        ),
        (RuntimeError("NetCDF: HDF error"), 10**12, r"as netCDF: NetCDF: HDF error$"),
    ],
)
def test_a_full_disk_is_named(work, capsys, monkeypatch, error, free, message):
    def fail(self, path, *args, **kwargs):
        Path(path).write_bytes(b"CDF partial")
        raise error

    monkeypatch.setattr(xr.Dataset, "to_netcdf", fail)
    if free is not None:
        usage = shutil.disk_usage(work)
        monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=free))
    argv = ["data", "import", str(work / "table.csv"), "--out", str(work / "d.nc")]
    _assert_fails(argv, capsys, work, message)


# -- the checks as a library function -------------------------------------------------
def test_output_file_checks_also_writes_against_inputs(tmp_path):
    data = tmp_path / "x.nc"
    data.write_bytes(b"data")
    with pytest.raises(OutputError, match=r"^its checkpoint \S*x\.nc is the same"):
        output_file(
            tmp_path / "f.nc",
            inputs={"--data": data},
            also_writes={"its checkpoint": data},
        )
    assert output_file(tmp_path / "f.nc", inputs={"--data": data}) == tmp_path / "f.nc"
    assert sorted(os.listdir(tmp_path)) == ["x.nc"]  # the probe is removed


def test_atomic_write_removes_its_temporary_on_failure(tmp_path):
    target = tmp_path / "t.bin"
    target.write_bytes(b"old")

    def write(tmp: Path):
        tmp.write_bytes(b"new, half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(target, write)
    assert target.read_bytes() == b"old"
    assert sorted(os.listdir(tmp_path)) == ["t.bin"]
