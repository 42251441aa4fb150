"""`epifit calibrate` through the CLI's `main`."""

import json
from pathlib import Path

import numpy as np
import pytest

from epifit.cli import main
from epifit.fitting import FitResult

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "models" / "sir.toml"
DATA = REPO / "data" / "boarding_school_1978.nc"
FIT = REPO / "models" / "sir_fit.toml"


@pytest.fixture(autouse=True)
def _no_persistent_cache(monkeypatch):
    """`main` would enable JAX's persistent compilation cache for the session."""
    monkeypatch.setenv("EPIFIT_NO_CACHE", "1")


def test_json_output_checkpoint_and_resume(tmp_path, capsys):
    out = tmp_path / "FIT.nc"
    argv = ["calibrate", str(MODEL), "--data", str(DATA), "--out", str(out)]
    argv += ["--fit", str(FIT), "--no-progress"]
    assert main([*argv, "--json", "--checkpoint-every", "3"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert set(summary) >= {"parameters", "loss", "iterations", "converged"}
    assert summary["converged"] is True
    assert set(summary["parameters"]) == {"N", "beta", "gamma", "I0", "R0"}
    assert summary["parameters"]["beta"] == pytest.approx(1.788, rel=1e-3)
    assert summary["intervals"]["R0"]["lower"] < summary["parameters"]["R0"]
    assert out.exists() and (tmp_path / "FIT.ckpt").exists()
    fit = FitResult.from_netcdf(out)
    assert fit.loss == summary["loss"]
    assert fit.settings["phases"][0]["method"] == "levenberg_marquardt"

    # --resume continues from the last checkpoint to the same numbers
    out2 = tmp_path / "FIT2.nc"
    (tmp_path / "FIT.ckpt").rename(tmp_path / "FIT2.ckpt")
    argv2 = ["calibrate", str(MODEL), "--data", str(DATA), "--out", str(out2)]
    assert main([*argv2, "--fit", str(FIT), "--no-progress", "--resume"]) == 0
    text = capsys.readouterr().out
    assert "converged" in text and "R0" in text and f"wrote {out2}" in text
    again = FitResult.from_netcdf(out2)
    assert again.iterations == fit.iterations
    np.testing.assert_allclose(again.x, fit.x, rtol=1e-12)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--fit", "FITFILE"], r"fit\.toml: phases\[0\]\.method: unknown value 'bfgs'"),
        (["--checkpoint-every", "0"], "--checkpoint-every must be >= 1"),
    ],
)
def test_errors_are_one_line_and_exit_code_2(tmp_path, capsys, extra, message):
    bad = tmp_path / "fit.toml"
    bad.write_text("[[phases]]\nmethod = 'bfgs'\n")
    extra = [str(bad) if e == "FITFILE" else e for e in extra]
    argv = ["calibrate", str(MODEL), "--data", str(DATA)]
    argv += ["--out", str(tmp_path / "x.nc"), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("epifit: error: ")
    assert len(err.strip().splitlines()) == 1
    import re

    assert re.search(message, err), err


def test_missing_files(tmp_path, capsys):
    argv = ["calibrate", str(MODEL), "--data", str(tmp_path / "no.nc")]
    assert main([*argv, "--out", str(tmp_path / "x.nc")]) == 2
    assert "Data file" in capsys.readouterr().err
    argv = ["calibrate", str(MODEL), "--data", str(DATA)]
    assert main([*argv, "--out", str(tmp_path / "nodir" / "x.nc")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_the_process_keeps_dask_out_and_writes_what_main_writes(tmp_path):
    """`python -m epifit calibrate` (`epifit.cli.run`): xarray does not import
    Dask (installed with the test extras) into a command that does not use
    it, and the file is the one `main` writes in a process that has Dask."""
    import subprocess
    import sys

    import xarray as xr

    argv = ["calibrate", str(MODEL), "--data", str(DATA), "--fit", str(FIT)]
    argv += ["--no-progress", "--max-iterations", "3"]
    # `run()` is what `python -m epifit` and the console script call
    code = (
        "import atexit, sys\n"
        "def report():\n"
        "    mods = [m for m, v in sys.modules.items() if v is not None]\n"
        "    print('IMPORTED', [m for m in mods if m.split('.')[0] in DASK])\n"
        "    print('XARRAY', 'xarray' in mods)\n"
        "DASK = ('dask', 'distributed')\n"
        "atexit.register(report)\n"
        "from epifit.cli import run\n"
        f"sys.argv = ['epifit', *{[*argv, '--out', 'a.nc']!r}]\n"
        "run()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "IMPORTED []" in proc.stdout and "XARRAY True" in proc.stdout, proc.stdout
    assert main([*argv, "--out", str(tmp_path / "b.nc")]) == 0
    assert "dask" in sys.modules  # this process has Dask: xarray imported it
    a, b = (xr.load_dataset(tmp_path / f) for f in ("a.nc", "b.nc"))
    varying = {"timing", "created", "command"}  # the run's clock and its --out
    assert a.attrs.keys() == b.attrs.keys()
    for ds in (a, b):
        ds.attrs = {k: v for k, v in ds.attrs.items() if k not in varying}
    assert a.identical(b)  # every variable, coordinate and attribute else
