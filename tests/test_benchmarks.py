"""The benchmarks run: `benchmarks/forward.py` and `benchmarks/gradient.py` on a
small reference problem, epifit only, write the JSON records the issues ask
for, and the gradient they time agrees with the shared runner's float64
reference. (Speed is measured by `make bench`, never here.)"""

import json
import subprocess
import sys
from pathlib import Path

import helpers
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
    helpers.import_reference()  # skips when ../shared/bench is absent
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
def test_gradient_benchmark_agrees_with_the_reference(tmp_path):
    helpers.import_reference()
    out = tmp_path / "gradient.json"
    run(
        "gradient.py",
        *("--tools", "epifit", "--adjoints", "checkpoint", "--skip", "epifit-bosh3"),
        *("--repeats", "2", "--budget", "5", "--ref-dir", str(tmp_path)),
        *("--json", str(out)),
    )
    (rec,) = json.loads(out.read_text())
    keys = ["tool", "adjoint", "default", "dtype", "n_patches", "fwd_compile_s"]
    keys += ["fwd_s", "grad_compile_s", "grad_s", "peak_rss_mb", "grad_rel_err"]
    check_record(rec, keys)
    assert rec["config"] == "epifit-checkpoint" and rec["default"] is True
    # float32 at rtol 1e-3 against the float64 reference (measured 8e-4); a
    # gradient of the wrong parameters or loss would be off by O(1)
    assert rec["grad_rel_err"] < 5e-3
    assert (tmp_path / "gradient_ref_12_15.npz").exists()
