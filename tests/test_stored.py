"""Programs kept across CLI runs (`epifit._stored`): a warm `epifit calibrate`
loads its programs instead of tracing them, gives the same fit, and traces
again when an input changes or a stored file does not load."""

import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import xarray as xr

import epifit._cache
from epifit._stored import _RUN, keyed_by_inputs, note_input, stored
from epifit.cli import main
from epifit.data import open_dataset, write_dataset

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def counted(monkeypatch):
    """Counts of `jax.export`'s exports and loads."""
    counts = {"export": 0, "deserialize": 0}
    export, deserialize = jax.export.export, jax.export.deserialize

    def counting_export(*a, **k):
        counts["export"] += 1
        return export(*a, **k)

    def counting_deserialize(*a, **k):
        counts["deserialize"] += 1
        return deserialize(*a, **k)

    monkeypatch.setattr(jax.export, "export", counting_export)
    monkeypatch.setattr(jax.export, "deserialize", counting_deserialize)
    return counts


@pytest.fixture
def cli(tmp_path, monkeypatch):
    """`epifit calibrate` of the boarding-school SIR (copies of its files in
    `tmp_path`), with the store in `tmp_path/cache` and the session's
    compilation cache left as it is; `run(out, plain=False)`."""
    monkeypatch.setattr(epifit._cache, "cache_dir", lambda: tmp_path / "cache")
    monkeypatch.setattr(epifit._cache, "enable_compilation_cache", lambda *a: None)
    files = {}
    names = ("models/sir.toml", "models/sir_fit.toml", "data/boarding_school_1978.nc")
    for name in names:
        files[name] = tmp_path / Path(name).name
        shutil.copyfile(REPO / name, files[name])

    def run(out, plain=False, uncertainty=False, extra=()):
        if plain:
            monkeypatch.setenv("EPIFIT_NO_CACHE", "1")
        else:
            monkeypatch.delenv("EPIFIT_NO_CACHE", raising=False)
        argv = ["calibrate", str(files["models/sir.toml"])]
        argv += ["--data", str(files["data/boarding_school_1978.nc"])]
        argv += ["--fit", str(files["models/sir_fit.toml"])]
        argv += ["--out", str(tmp_path / out), "--max-iterations", "8"]
        argv += [] if uncertainty else ["--no-uncertainty"]
        argv += ["--no-progress", *extra]
        assert main(argv) == 0
        return open_dataset(tmp_path / out)

    run.files = files
    return run


def _same_fit(a: xr.Dataset, b: xr.Dataset) -> None:
    assert set(a.data_vars) == set(b.data_vars)
    for v in a.data_vars:
        np.testing.assert_array_equal(a[v].values, b[v].values, err_msg=v)


def test_a_warm_run_loads_its_programs_and_fits_the_same(cli, counted, tmp_path):
    first = cli("a.nc")
    # the residuals and Jacobian (Levenberg-Marquardt's start), the
    # optimiser's chunk and the output program
    assert counted == {"export": 3, "deserialize": 0}
    assert len(list((tmp_path / "cache" / "programs").iterdir())) == 3
    second = cli("b.nc")
    assert counted == {"export": 3, "deserialize": 3}
    plain = cli("c.nc", plain=True)
    assert counted == {"export": 3, "deserialize": 3}
    _same_fit(first, second)
    _same_fit(first, plain)


def test_the_laplace_hessian_is_kept_too(cli, counted):
    fit = cli.files["models/sir_fit.toml"]
    fit.write_text(fit.read_text().replace('"gauss_newton"', '"hessian"'))
    first = cli("a.nc", uncertainty=True)
    # the residuals and Jacobian, the chunk, the data Hessian, the outputs
    assert counted == {"export": 4, "deserialize": 0}
    second = cli("b.nc", uncertainty=True)
    assert counted == {"export": 4, "deserialize": 4}
    _same_fit(first, second)
    _same_fit(first, cli("c.nc", plain=True, uncertainty=True))


def test_a_changed_input_is_traced_again(cli, counted):
    cli("a.nc")
    data = cli.files["data/boarding_school_1978.nc"]
    ds = open_dataset(data)
    ds["in_bed"][3] = ds["in_bed"][3] + 40
    write_dataset(ds, data)
    changed = cli("b.nc")
    assert counted["export"] == 6
    # the fit saw the new data: the same as a run without the store
    _same_fit(changed, cli("c.nc", plain=True))
    model = cli.files["models/sir.toml"]
    model.write_text(model.read_text() + "\n# a comment\n")
    cli("d.nc")
    assert counted["export"] == 9


def test_an_unreadable_stored_program_is_exported_again(cli, counted, tmp_path):
    first = cli("a.nc")
    for p in (tmp_path / "cache" / "programs").iterdir():
        p.write_bytes(p.read_bytes()[:100])
    second = cli("b.nc")
    assert counted["export"] == 6
    _same_fit(first, second)


def _double(x, y):
    return {"sum": x + y, "pair": [x, None, (2.0 * y,)]}


def test_outside_the_context_nothing_is_stored(tmp_path, counted):
    f = stored("double", _double, out_tree=None)
    x, y = jnp.arange(3.0), jnp.ones(3)
    out = f(x, y)
    np.testing.assert_array_equal(out["sum"], x + y)
    assert counted["export"] == 0


def test_stored_programs_round_trip_and_fall_back(tmp_path, counted):
    x, y = jnp.arange(3.0), jnp.ones(3)
    want = jax.jit(_double)(x, y)
    with keyed_by_inputs({"command": "test"}, tmp_path):
        got = stored("double", _double, out_tree=None)(x, y)
    with keyed_by_inputs({"command": "test"}, tmp_path):
        # the same program first (as a run with the same inputs calls it)
        loaded = stored("double", _double, out_tree=None)(x, y)
        again = stored("double", _double, out_tree=None)(x, 1.0)
    assert counted == {"export": 2, "deserialize": 1}
    for out in (got, loaded):
        assert jax.tree.structure(out) == jax.tree.structure(want)
        for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(again["sum"], x + 1.0)

    # compiled ahead of time (for threads), in the store and outside it
    with keyed_by_inputs({"command": "test"}, tmp_path):
        program = stored("double", _double, out_tree=None).compiled(x, y)
    assert counted == {"export": 2, "deserialize": 2}
    outside = stored("double", _double, out_tree=None).compiled(x, y)
    for out in (program(x, y), outside(x, y)):
        np.testing.assert_array_equal(out["pair"][2][0], 2.0 * y)

    # a structure given by the caller; a program that cannot be exported (a
    # host callback) runs as itself and stores nothing
    def noisy(x):
        jax.debug.callback(lambda v: None, x)
        return (x * 2.0, x)

    files = set((tmp_path / "programs").iterdir())
    with keyed_by_inputs({"command": "test"}, tmp_path):
        out = stored("noisy", noisy, out_tree=lambda x: jax.tree.structure((0, 0)))(x)
    np.testing.assert_array_equal(out[0], 2.0 * x)
    assert set((tmp_path / "programs").iterdir()) == files


def test_the_key_covers_the_files_read(tmp_path):
    p = tmp_path / "m.toml"
    p.write_text("a = 1\n")
    note_input(p)  # outside the context: nothing to record, no error
    with keyed_by_inputs({"command": "test"}, tmp_path):
        run = _RUN.get()
        note_input(p)
        before = run.digest()
        p.write_text("a = 2\n")
        note_input(p)
        assert run.digest() != before
        p.write_text("a = 1\n")
        note_input(p)
        assert run.digest() == before


def test_a_store_that_cannot_be_written_is_skipped(tmp_path, counted):
    blocked = tmp_path / "a file, not a folder"
    blocked.write_text("")
    x, y = jnp.arange(3.0), jnp.ones(3)
    with keyed_by_inputs({"command": "test"}, blocked):
        out = stored("double", _double, out_tree=None)(x, y)
    np.testing.assert_array_equal(out["sum"], x + y)
    assert counted["export"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [blocked.name]


def test_programs_of_one_name_are_told_apart_by_their_order(tmp_path, counted):
    x = jnp.arange(3.0)
    runs = []
    for _ in range(2):
        with keyed_by_inputs({"command": "test"}, tmp_path):
            runs.append(
                [
                    stored("same name", fn, out_tree=None)(x)
                    for fn in (jnp.sin, jnp.cos, jnp.sin)
                ]
            )
    assert counted == {"export": 3, "deserialize": 3}
    for outs in runs:
        for out, fn in zip(outs, (jnp.sin, jnp.cos, jnp.sin), strict=True):
            np.testing.assert_array_equal(out, fn(x))


def test_a_warm_forecast_loads_its_program(cli, counted, tmp_path, monkeypatch):
    cli("fit.nc", uncertainty=True)
    fitted = counted["export"]

    def forecast(out, plain=False):
        if plain:
            monkeypatch.setenv("EPIFIT_NO_CACHE", "1")
        else:
            monkeypatch.delenv("EPIFIT_NO_CACHE", raising=False)
        argv = ["forecast", str(tmp_path / "fit.nc"), "--out", str(tmp_path / out)]
        assert main([*argv, "--days", "10", "--samples", "20", "--seed", "3"]) == 0
        return open_dataset(tmp_path / out)

    first = forecast("a.nc")
    exported = counted["export"]
    assert exported > fitted  # the ensemble's program
    second = forecast("b.nc")
    assert counted["export"] == exported
    _same_fit(first, second)
    _same_fit(first, forecast("c.nc", plain=True))


def test_runs_that_follow_the_clock_or_a_checkpoint_keep_nothing(cli, counted):
    cli("a.nc", extra=["--time-budget", "600"])
    cli("b.nc", extra=["--checkpoint-every", "2"])
    exported = counted["export"]
    assert exported == 3
    cli("c.nc", extra=["--resume", "--checkpoint-every", "2"])
    assert counted["export"] == exported
