"""Batch files, their tasks and fingerprints, the worker environment, the Slurm
example of docs/batch.md, and the CLI's errors (no cluster; see
test_batch_cluster.py for the runs)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from epifit.batch import BatchError, load_batch, parse_batch, worker_env
from epifit.batch._run import _inputs
from epifit.batch._task import TaskInput, _dataset
from epifit.cli import main
from epifit.data import open_dataset, write_dataset

REPO = Path(__file__).resolve().parents[1]
SIR = REPO / "models" / "sir.toml"
SIR_FIT = REPO / "models" / "sir_fit.toml"
BOARDING = REPO / "data" / "boarding_school_1978.nc"
METAPOP = REPO / "data" / "synthetic_metapop_20.nc"


@pytest.fixture()
def folder(tmp_path):
    """A batch folder: models/ with the SIR and its fit file, two datasets."""
    (tmp_path / "models").mkdir()
    shutil.copy(SIR, tmp_path / "models" / "sir.toml")
    shutil.copy(SIR_FIT, tmp_path / "models" / "sir_fit.toml")
    (tmp_path / "regions").mkdir()
    ds = open_dataset(BOARDING)
    write_dataset(ds, tmp_path / "regions" / "a.nc")
    other = ds.copy(deep=True)
    other["in_bed"] = np.round(0.8 * other["in_bed"])
    write_dataset(other, tmp_path / "regions" / "b.nc")
    return tmp_path


def _write(folder: Path, text: str) -> Path:
    path = folder / "batch.toml"
    path.write_text(text)
    return path


ISSUE_FORM = """
model = "models/sir.toml"
data = ["regions/a.nc", "regions/b.nc"]
seeds = [0, 1, 2, 3]
fit = "models/sir_fit.toml"
"""


def test_the_issue_form_gives_two_by_four_tasks(folder):
    spec = load_batch(_write(folder, ISSUE_FORM))
    assert len(spec.tasks) == 8
    coords = [t.coordinates(spec.root) for t in spec.tasks]
    assert {(c["dataset"], c["seed"]) for c in coords} == {
        (f"regions/{d}.nc", s) for d in "ab" for s in range(4)
    }
    assert {c["model"] for c in coords} == {"models/sir.toml"}
    assert {c["fit"] for c in coords} == {"models/sir_fit.toml"}
    assert len({t.key for t in spec.tasks}) == 8
    # a glob names the same files, sorted, so the same tasks
    globbed = load_batch(
        _write(
            folder,
            ISSUE_FORM.replace('["regions/a.nc", "regions/b.nc"]', '"regions/*.nc"'),
        )
    )
    assert [t.key for t in globbed.tasks] == [t.key for t in spec.tasks]


def test_absolute_paths_and_defaults(folder, tmp_path_factory):
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    text = f'model = "{folder / "models" / "sir.toml"}"\ndata = "{BOARDING}"\n'
    spec = load_batch(_write(elsewhere, text))
    (task,) = spec.tasks
    assert (task.seed, task.fit, task.patch, task.forecast) == (0, "", "", None)
    assert task.data == str(BOARDING.resolve())


def test_adding_a_seed_keeps_the_other_tasks_keys(folder):
    before = {t.key for t in load_batch(_write(folder, ISSUE_FORM)).tasks}
    more = ISSUE_FORM.replace("[0, 1, 2, 3]", "[0, 1, 2, 3, 4]")
    after = {t.key for t in load_batch(_write(folder, more)).tasks}
    assert before < after and len(after - before) == 2


def test_split_by_patch_slices_every_patch_variable(tmp_path):
    text = f'model = "{SIR}"\ndata = "{METAPOP}"\nsplit = "patch"\nseeds = [0, 1]\n'
    spec = load_batch(_write(tmp_path, text))
    ds = open_dataset(METAPOP)
    assert len(spec.tasks) == 2 * ds.sizes["patch"]
    task = next(t for t in spec.tasks if t.patch == "p07" and t.seed == 1)
    sliced = _dataset(_task_input(task, tmp_path))
    assert sliced.sizes["patch"] == 1 and sliced.sizes["patch_to"] == 1
    np.testing.assert_array_equal(
        sliced["new_infections"].values[:, 0],
        ds["new_infections"].sel(patch="p07").values,
    )
    np.testing.assert_array_equal(
        sliced["coupling"].values[:, 0, 0],
        ds["coupling"].sel(patch="p07", patch_to="p07").values,
    )


def _task_input(task, folder: Path) -> TaskInput:
    spec_like = type("S", (), {"tasks": (task,), "root": folder})
    (x,) = _inputs(spec_like, folder, True, None)
    return x


def test_the_fingerprint_follows_the_inputs(folder):
    spec = load_batch(_write(folder, ISSUE_FORM))
    first = {x.key: x.fingerprint for x in _inputs(spec, folder, True, None)}
    assert first == {x.key: x.fingerprint for x in _inputs(spec, folder, True, None)}
    # another precision: every task again
    f32 = {x.key: x.fingerprint for x in _inputs(spec, folder, False, None)}
    assert all(f32[k] != v for k, v in first.items())
    # data b changed: only b's tasks again
    b = folder / "regions" / "b.nc"
    ds = open_dataset(b)
    ds["in_bed"] = ds["in_bed"] + 1.0
    write_dataset(ds, b)
    after = {x.key: x.fingerprint for x in _inputs(spec, folder, True, None)}
    changed = {
        t.coordinates(spec.root)["dataset"]
        for t in spec.tasks
        if after[t.key] != first[t.key]
    }
    assert changed == {"regions/b.nc"}


BAD = [
    ('data = "regions/a.nc"', r"batch.toml: model: missing required field 'model'"),
    (
        'model = "models/sir.toml"\ndata = "regions/*.csv"',
        r"batch.toml: data: glob 'regions/\*.csv' matches no file",
    ),
    (
        'model = "models/sir.toml"\ndata = ["regions/a.nc", "regions/c.nc"]',
        r"batch.toml: data\[1\]: Data file .*regions/c.nc does not exist",
    ),
    (
        'model = "models/sir.toml"\ndata = ["regions/a.nc", "regions/*.nc"]',
        r"batch.toml: data\[1\]: data file .*a.nc is listed twice",
    ),
    (
        'model = "models/sir.toml"\ndata = "regions/a.nc"\nseeds = [0, -1]',
        r"batch.toml: seeds\[1\]: must be an integer >= 0, got -1",
    ),
    (
        'model = "models/sir.toml"\ndata = "regions/a.nc"\nseeds = [2, 2]',
        r"batch.toml: seeds: a seed is listed twice",
    ),
    (
        'model = "models/sir.toml"\ndata = "regions/a.nc"\nsplit = "region"',
        r"batch.toml: split: unknown value 'region'; expected one of: patch",
    ),
    (
        'model = "models/sir.toml"\ndata = "regions/a.nc"\nsede = [1]',
        r"batch.toml: sede: unknown field 'sede'",
    ),
    (
        'model = "models/sir.toml"\ndata = "regions/a.nc"\n'
        "[calibrate]\nmax_iterations = 0",
        r"batch.toml: calibrate.max_iterations: must be an integer >= 1, got 0",
    ),
    (
        'model = "models/sir.toml"\ndata = "regions/a.nc"\n[calibrate]\nlr = 1',
        r"batch.toml: calibrate.lr: unknown field 'lr'",
    ),
    (
        'model = "models/sir.toml"\ndata = "regions/a.nc"\n[forecast]\nsamples = 5',
        r"batch.toml: forecast.days: missing required field 'days'",
    ),
    (
        'model = "models/sir.toml"\ndata = "regions/a.nc"\nfit = "models/sir.toml"',
        r"sir.toml: .*unknown field",  # a model file given as the fit file
    ),
    ('model = "models/sir.toml"\ndata = [', r"batch.toml: line 2: invalid TOML"),
]


@pytest.mark.parametrize("text, match", BAD)
def test_bad_batch_files_fail_in_one_located_line(folder, text, match):
    with pytest.raises(ValueError, match=match) as e:
        load_batch(_write(folder, text))
    assert "\n" not in str(e.value)


def test_parse_batch_reads_a_dict_relative_to_root(folder):
    spec = parse_batch(
        {"model": "models/sir.toml", "data": "regions/*.nc", "seeds": [3]},
        root=folder,
    )
    assert [t.seed for t in spec.tasks] == [3, 3]
    with pytest.raises(BatchError, match="batch: seeds: expected an array"):
        parse_batch(
            {"model": "models/sir.toml", "data": "regions/a.nc", "seeds": 3},
            root=folder,
        )


def test_the_worker_environment_limits_xla_to_one_thread(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    env = worker_env("/shared/cache")
    assert env["XLA_FLAGS"] == (
        "--xla_dump_to=/tmp/x --xla_cpu_multi_thread_eigen=false "
        "intra_op_parallelism_threads=1"
    )
    assert env["EPIFIT_CACHE_DIR"] == "/shared/cache"
    assert env["OMP_NUM_THREADS"] == "1"
    monkeypatch.delenv("XLA_FLAGS")
    assert "EPIFIT_CACHE_DIR" not in worker_env()


def test_the_slurm_example_of_the_docs_renders_its_job_script():
    text = (REPO / "docs" / "batch.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    (example,) = [b for b in blocks if "SLURMCluster(" in b]
    namespace: dict = {}
    exec(
        compile(example.replace("print(job_script)", ""), "docs/batch.md", "exec"),
        namespace,
    )
    cluster = namespace["cluster"]
    try:
        script = namespace["job_script"]
    finally:
        cluster.close()
    lines = script.splitlines()
    for expected in (
        "#SBATCH -p compute",
        "#SBATCH -A my-project",
        "#SBATCH --cpus-per-task=1",
        "#SBATCH -t 02:00:00",
        "export XLA_FLAGS='--xla_cpu_multi_thread_eigen=false "
        "intra_op_parallelism_threads=1'",
        "export EPIFIT_CACHE_DIR=/shared/cache/epifit-jax",
        "export OMP_NUM_THREADS=1",
    ):
        assert expected in lines, expected
    (worker,) = [line for line in lines if "distributed.cli.dask_worker" in line]
    assert "--nthreads 1" in worker and cluster.scheduler_address in worker
    # the rendered script the docs show is this one, up to the addresses
    documented = re.search(r"```bash\n(.*?)```", text, flags=re.S).group(1)
    assert [
        line for line in documented.splitlines() if line.startswith(("#", "export"))
    ] == [line for line in lines if line.startswith(("#", "export"))]


def test_the_cli_refuses_bad_batches_and_flags(folder, capsys):
    out = folder / "results"
    bad = _write(folder, 'model = "models/sir.toml"\ndata = "regions/z.nc"')
    assert main(["batch", str(bad), "--out", str(out)]) == 2
    assert "data: Data file" in capsys.readouterr().err
    assert not out.exists()  # refused before any work
    good = _write(folder, ISSUE_FORM)
    assert main(["batch", str(good), "--out", str(out), "--workers", "0"]) == 2
    assert "--workers must be >= 1; got 0" in capsys.readouterr().err
    both = main(
        [
            "batch",
            str(good),
            "--out",
            str(out),
            "--workers",
            "2",
            "--scheduler",
            "tcp://x:8786",
        ]
    )
    assert both == 2 and "not allowed with" in capsys.readouterr().err
    (folder / "file").write_text("")
    assert main(["batch", str(good), "--out", str(folder / "file")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    assert main(["batch", str(folder / "none.toml"), "--out", str(out)]) == 2
    assert "Batch file" in capsys.readouterr().err


@pytest.mark.slow
def test_a_task_fits_forecasts_and_merges_without_a_cluster(folder, monkeypatch):
    """`run_task` in this process (what a worker runs): the fit's FIT.nc, one
    forecast per scenario file, the summary, and their merge; a failing task
    beside it."""
    from epifit.batch._merge import merge_tasks
    from epifit.batch._task import run_task
    from epifit.fitting import FitResult

    monkeypatch.setenv("EPIFIT_NO_CACHE", "1")  # no cache in this process
    (folder / "halve.toml").write_text(
        "[scenarios.halve]\nchanges = [{ parameter = 'beta', scale = 0.5 }]\n"
    )
    text = ISSUE_FORM.replace("[0, 1, 2, 3]", "[5]") + (
        "[calibrate]\nmax_iterations = 3\nuncertainty = 'gauss_newton'\n"
        "[forecast]\ndays = 7\nsamples = 4\nscenarios = ['halve.toml']\n"
    )
    spec = load_batch(_write(folder, text))
    tasks_dir = folder / "tasks"
    tasks_dir.mkdir()
    inputs = _inputs(spec, tasks_dir, True, None)
    empty = open_dataset(BOARDING).drop_vars("in_bed")
    write_dataset(empty, folder / "empty.nc")
    broken = dataclasses.replace(inputs[1], data=str(folder / "empty.nc"))
    summaries = [run_task(inputs[0]), run_task(broken)]
    assert [s["status"] for s in summaries] == ["ok", "failed"]
    assert summaries[1]["error"].startswith("DataError: ")
    assert "in_bed" in summaries[1]["error"]
    ds = merge_tasks(
        [inputs[0], broken],
        tasks_dir,
        {},
        {"batch_file": "b"},
        scenarios=spec.scenarios,
        root=spec.root,
    )
    assert list(ds["status"].values) == ["ok", "failed"]
    assert ds["error"].values[1] == summaries[1]["error"]
    assert (ds["start_time"] <= ds["end_time"]).all()
    assert ds["start_time"].dtype == np.dtype("datetime64[ns]")
    assert (ds["wall_s"] >= ds["fit_s"]).all() and (ds["fit_s"] > 0).all()
    fit = FitResult.from_netcdf(tasks_dir / str(ds["fit_file"].values[0]))
    np.testing.assert_array_equal(
        ds["estimate"].values[0], [r["estimate"] for r in fit.table]
    )
    assert fit.settings["seed"] == 5 and fit.iterations == 3
    # the scenario dimension: the baseline and halve, both in the one forecast
    assert list(ds["scenario"].values) == ["baseline", "halve"]
    assert list(ds["scenario_file"].values) == ["halve.toml"] * 2
    (name,) = set(ds["forecast_file"].values[0])
    assert list(ds["forecast_file"].values[1]) == ["", ""]
    forecast = open_dataset(tasks_dir / name)
    assert forecast.attrs["epifit_kind"] == "forecast"
    assert [str(s) for s in forecast["scenario"].values] == ["baseline", "halve"]
    for s in ("baseline", "halve"):
        # the median of the forecast's cumulative in_bed over the days
        want = forecast["cumulative_in_bed_total"].sel(scenario=s, quantile=0.5)
        got = ds["forecast_cumulative"].sel(scenario=s).values[0]
        assert got == float(want) and np.isfinite(got)
    assert np.isnan(ds["forecast_cumulative"].values[1]).all()
    assert ds["fit_file"].values[1] == "" and np.isnan(ds["estimate"].values[1]).all()
    _check_bootstrap_data(tasks_dir / str(ds["fit_file"].values[0]))


def _check_bootstrap_data(fit_file: Path) -> None:
    """Both kinds of draw from a task's FIT.nc, the data with one day
    missing: parametric is `simulate(observe="model")` at the fit, residual
    the prediction plus residuals of the fit drawn from its own set; the
    missing day stays missing."""
    from epifit import simulate
    from epifit.batch import bootstrap_data
    from epifit.fitting import FitResult

    ds = open_dataset(BOARDING).load()
    ds["in_bed"] = ds["in_bed"].astype(float)
    ds["in_bed"][3] = np.nan
    fit = FitResult.from_netcdf(fit_file, data=ds)
    observed = ds["in_bed"].values
    seen = np.isfinite(observed)
    # the fit file's tolerances
    sim = simulate(
        fit.model, ds, params=fit.params, observe="model", seed=9, rtol=1e-8, atol=1e-8
    )
    predicted = sim["predicted_in_bed"].values[:, 0]
    para = bootstrap_data(fit, ds, kind="parametric", seed=9)
    np.testing.assert_array_equal(
        para["in_bed"].values[:, 0], np.where(seen, sim["in_bed"].values[:, 0], np.nan)
    )
    resid = bootstrap_data(fit, ds, kind="residual", seed=9)
    drawn = resid["in_bed"].values[:, 0]
    assert np.isnan(drawn[~seen]).all() and np.isfinite(drawn[seen]).all()
    residuals = observed[seen] - predicted[seen]
    for d, p in zip(drawn[seen], predicted[seen], strict=True):
        # each point is its prediction plus one of the residuals (or 0)
        assert d == 0.0 or np.isclose(d - p, residuals, rtol=0, atol=1e-9).any()
    assert len(set(np.round(drawn[seen] - predicted[seen], 9))) > 1


# -- bootstrap replicates and scenarios ------------------------------------------
BOOTSTRAP = ISSUE_FORM + (
    "[bootstrap]\nreplicates = 3\nkind = 'parametric'\nseed = 11\n"
)


def test_bootstrap_replicates_follow_their_originals(folder):
    plain = load_batch(_write(folder, ISSUE_FORM))
    spec = load_batch(_write(folder, BOOTSTRAP))
    originals, replicates = spec.tasks[:8], spec.tasks[8:]
    assert len(replicates) == 8 * 3
    # the originals are the batch without bootstrap: same keys, same files
    assert [t.key for t in originals] == [t.key for t in plain.tasks]
    assert all(t.replicate == -1 and t.original == t.index for t in originals)
    for t in replicates:
        o = spec.tasks[t.original]
        assert (t.model, t.data, t.fit, t.seed) == (o.model, o.data, o.fit, o.seed)
        assert o.replicate == -1 and t.forecast is None
    assert sorted((t.original, t.replicate) for t in replicates) == [
        (i, j) for i in range(8) for j in range(3)
    ]
    assert len({t.key for t in spec.tasks}) == 32
    assert spec.bootstrap.level == 0.95 and spec.bootstrap.seed == 11


def _seed(seed: int, key: str, replicate: int) -> int:
    """The replicate seed as docs/batch.md defines it."""
    digest = hashlib.sha256(json.dumps([seed, key, replicate]).encode()).digest()
    return int.from_bytes(digest[:4], "big")


def test_replicate_seeds_and_fingerprints(folder):
    spec = load_batch(_write(folder, BOOTSTRAP))
    inputs = _inputs(spec, folder, True, None)
    by_key = {x.key: x for x in inputs}
    reps = [x for x in inputs if x.replicate >= 0]
    for x in reps:
        assert x.replicate_seed == _seed(11, x.original_key, x.replicate)
        assert x.coordinates["original"] == x.original_key
        assert by_key[x.original_key].replicate == -1
    assert len({x.replicate_seed for x in reps}) == len(reps)
    assert all(x.replicate_seed == -1 for x in inputs if x.replicate < 0)
    # the same batch file gives the same seeds and fingerprints
    again = _inputs(load_batch(_write(folder, BOOTSTRAP)), folder, True, None)
    assert [(x.replicate_seed, x.fingerprint) for x in again] == [
        (x.replicate_seed, x.fingerprint) for x in inputs
    ]
    # another bootstrap seed: the replicates again, not the originals
    other = _inputs(
        load_batch(_write(folder, BOOTSTRAP.replace("seed = 11", "seed = 12"))),
        folder,
        True,
        None,
    )
    for a, b in zip(inputs, other, strict=True):
        assert a.key == b.key
        assert (a.fingerprint == b.fingerprint) == (a.replicate < 0)
    # data b changed: b's originals and their replicates
    path = folder / "regions" / "b.nc"
    ds = open_dataset(path)
    ds["in_bed"] = ds["in_bed"] + 1.0
    write_dataset(ds, path)
    after = _inputs(spec, folder, True, None)
    for a, b in zip(inputs, after, strict=True):
        changed = a.fingerprint != b.fingerprint
        assert changed == (a.coordinates["dataset"] == "regions/b.nc")


BAD_BOOTSTRAP = [
    ("bootstrap = 3", r"batch.toml: bootstrap: expected a table"),
    ("[bootstrap]\nkind = 'case'", r"bootstrap.replicates: missing required field"),
    ("[bootstrap]\nreplicates = 0", r"bootstrap.replicates: must be an integer >= 1"),
    (
        "[bootstrap]\nreplicates = 2\nkind = 'jackknife'",
        r"bootstrap.kind: unknown value 'jackknife'; expected one of: parametric, "
        "residual",
    ),
    ("[bootstrap]\nreplicates = 2\nseed = -1", r"bootstrap.seed: must be an integer"),
    ("[bootstrap]\nreplicates = 2\nlevel = 1.5", r"bootstrap.level: must be in"),
    ("[bootstrap]\nreplicates = 2\nsamples = 5", r"bootstrap.samples: unknown field"),
]


@pytest.mark.parametrize("table, match", BAD_BOOTSTRAP)
def test_bad_bootstrap_tables_fail_in_one_located_line(folder, table, match):
    text = 'model = "models/sir.toml"\ndata = "regions/a.nc"\n' + table
    with pytest.raises(BatchError, match=match) as e:
        load_batch(_write(folder, text))
    assert "\n" not in str(e.value) and "batch.toml" in str(e.value)


def test_a_scenario_named_in_two_files_is_refused(folder):
    for name in ("x.toml", "y.toml"):
        (folder / name).write_text(
            "[scenarios.halve]\nchanges = [{ parameter = 'beta', scale = 0.5 }]\n"
        )
    text = ISSUE_FORM + "[forecast]\ndays = 3\nscenarios = ['x.toml', 'y.toml']\n"
    with pytest.raises(
        BatchError, match=r"forecast.scenarios\[1\]: scenario 'halve' of .*y.toml"
    ):
        load_batch(_write(folder, text))
    (folder / "y.toml").write_text("[scenarios.halve]\nchanges = 3\n")
    with pytest.raises(BatchError, match=r"forecast.scenarios\[1\]: .*y.toml"):
        load_batch(_write(folder, text))


def _fake_task(
    x: TaskInput, tasks_dir: Path, estimates, status="ok", forecasts=(), medians=None
) -> None:
    """A task file as `run_task` writes it, with given estimates."""
    import xarray as xr

    from epifit.batch._task import TASK_KIND

    labels = ["beta", "gamma", "R0"]
    est = np.asarray(estimates, float)
    ds = xr.Dataset(
        {k: ("parameter", est) for k in ("estimate", "se", "lower", "upper")},
        coords={"parameter": labels, "parameter_name": ("parameter", labels)},
    )
    ds.attrs = dict(
        epifit_kind=TASK_KIND,
        key=x.key,
        fingerprint=x.fingerprint,
        status=status,
        error="" if status == "ok" else "ValueError: no",
        fit_file=f"{x.key}.fit.nc" if status == "ok" else "",
        forecast_files=json.dumps(list(forecasts)),
        forecast_cumulative=json.dumps(medians or {}),
    )
    write_dataset(ds, tasks_dir / f"{x.key}.nc")


def test_the_merge_gives_percentile_intervals_per_original(folder):
    """Two originals with 5 replicates each, estimates chosen here: the
    intervals are NumPy's percentiles of the ok replicates; a failed and a
    missing replicate are left out; an original with no ok replicate has
    NaN."""
    from epifit.batch._merge import merge_tasks

    text = ISSUE_FORM.replace('["regions/a.nc", "regions/b.nc"]', '"regions/a.nc"')
    text = text.replace("[0, 1, 2, 3]", "[0, 1]") + "[bootstrap]\nreplicates = 5\n"
    spec = load_batch(_write(folder, text))
    tasks_dir = folder / "tasks"
    tasks_dir.mkdir()
    inputs = _inputs(spec, tasks_dir, True, None)
    rng = np.random.default_rng(0)
    values = rng.normal([2.0, 0.5, 4.0], [0.1, 0.02, 0.3], size=(len(inputs), 3))
    first = [x for x in inputs if x.replicate >= 0 and x.original_key == inputs[0].key]
    second = [x for x in inputs if x.replicate >= 0 and x.original_key == inputs[1].key]
    for i, x in enumerate(inputs):
        if x is first[3]:
            continue  # never written: failed with its message
        failed = x is first[1] or x in second
        _fake_task(x, tasks_dir, values[i], "failed" if failed else "ok")
    ds = merge_tasks(inputs, tasks_dir, {first[3].key: "killed"}, {}, level=0.9)
    assert list(ds["replicate"].values) == [-1, -1, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4]
    assert (
        list(ds["original"].values)
        == [inputs[0].key, inputs[1].key] + [inputs[0].key] * 5 + [inputs[1].key] * 5
    )
    assert ds["error"].sel(task=first[3].key).item() == "killed"
    kept = [inputs.index(x) for x in first if x not in (first[1], first[3])]
    want = np.percentile(values[kept], [5.0, 95.0], axis=0)
    np.testing.assert_allclose(ds["bootstrap_lower"].values[0], want[0], rtol=1e-15)
    np.testing.assert_allclose(ds["bootstrap_upper"].values[0], want[1], rtol=1e-15)
    assert list(ds["bootstrap_n"].values[:2]) == [3, 0]
    assert np.isnan(ds["bootstrap_lower"].values[1:]).all()
    assert np.isnan(ds["bootstrap_upper"].values[1:]).all()
    assert list(ds["replicate_seed"].values[:2]) == [-1, -1]
    assert ds.attrs["bootstrap_level"] == 0.9
    assert "scenario" not in ds.dims


def test_the_merge_gives_a_scenario_dimension(folder):
    from epifit.batch._merge import merge_tasks

    (folder / "scenarios").mkdir()
    (folder / "scenarios" / "x.toml").write_text(
        "[scenarios.halve]\nchanges = [{ parameter = 'beta', scale = 0.5 }]\n"
        "[scenarios.stop]\nchanges = [{ parameter = 'beta', scale = 0.1 }]\n"
    )
    (folder / "scenarios" / "y.toml").write_text(
        "[scenarios.double]\nchanges = [{ parameter = 'beta', scale = 2.0 }]\n"
    )
    text = ISSUE_FORM.replace("[0, 1, 2, 3]", "[0]") + (
        "[forecast]\ndays = 3\nscenarios = ['scenarios/x.toml', 'scenarios/y.toml']\n"
    )
    spec = load_batch(_write(folder, text))
    assert [name for name, _ in spec.scenarios] == [
        "baseline",
        "halve",
        "stop",
        "double",
    ]
    tasks_dir = folder / "tasks"
    tasks_dir.mkdir()
    inputs = _inputs(spec, tasks_dir, True, None)
    files = [f"{inputs[0].key}.forecast-0.nc", f"{inputs[0].key}.forecast-1.nc"]
    medians = {"baseline": 10.0, "halve": 5.0, "stop": 1.0, "double": 20.0}
    _fake_task(inputs[0], tasks_dir, [2, 0.5, 4], forecasts=files, medians=medians)
    _fake_task(inputs[1], tasks_dir, [np.nan] * 3, "failed")
    ds = merge_tasks(inputs, tasks_dir, {}, {}, scenarios=spec.scenarios, root=folder)
    assert list(ds["scenario"].values) == ["baseline", "halve", "stop", "double"]
    assert list(ds["scenario_file"].values) == [
        "scenarios/x.toml",
        "scenarios/x.toml",
        "scenarios/x.toml",
        "scenarios/y.toml",
    ]
    assert ds["forecast_file"].dims == ("task", "scenario")
    assert list(ds["forecast_file"].values[0]) == [files[0]] * 3 + [files[1]]
    assert list(ds["forecast_file"].values[1]) == [""] * 4
    np.testing.assert_array_equal(
        ds["forecast_cumulative"].values[0], [10.0, 5.0, 1.0, 20.0]
    )
    assert np.isnan(ds["forecast_cumulative"].values[1]).all()


def test_replicates_of_a_failed_original_fail_without_running(folder):
    from epifit.batch._run import _Plan

    text = ISSUE_FORM.replace("[0, 1, 2, 3]", "[0]") + "[bootstrap]\nreplicates = 2\n"
    spec = load_batch(_write(folder, text))
    tasks_dir = folder / "tasks"
    tasks_dir.mkdir()
    inputs = _inputs(spec, tasks_dir, True, None)
    a, b = inputs[:2]
    reps: dict[str, list] = {x.key: [] for x in (a, b)}
    for x in inputs[2:]:
        reps[x.original_key].append(x)
    # resumed: a kept as ok, b kept as failed; their replicates to do
    _fake_task(a, tasks_dir, [2, 0.5, 4])
    _fake_task(b, tasks_dir, [np.nan] * 3, "failed")
    missing: dict[str, str] = {}
    plan = _Plan(inputs, inputs[2:], tasks_dir, missing)
    assert [x.key for x in plan.first] == [x.key for x in reps[a.key]]
    assert set(missing) == {x.key for x in reps[b.key]}
    assert all(
        f"original task {b.key} failed: ValueError" in m for m in missing.values()
    )
    # a fresh batch: replicates wait for their original
    missing = {}
    plan = _Plan(inputs, inputs, tasks_dir, missing)
    assert [x.key for x in plan.first] == [a.key, b.key]
    assert [x.key for x in plan.on_done(a, {"status": "ok"})] == [
        x.key for x in reps[a.key]
    ]
    assert plan.on_done(b, {"status": "failed", "error": "x"}) == []
    assert set(missing) == {x.key for x in reps[b.key]}
    assert plan.submitted == {a.key, b.key} | {x.key for x in reps[a.key]}
