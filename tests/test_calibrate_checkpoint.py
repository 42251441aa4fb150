"""Checkpoints: atomic writes, and resuming after SIGKILL to the same numbers."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

import epifit
from epifit.fitting import CheckpointError, _checkpoint

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "models" / "sir.toml"
DATA = REPO / "data" / "boarding_school_1978.nc"
# Adam then L-BFGS: both optimiser states (moments, schedule count, L-BFGS
# memory and line-search state) must survive the round trip
SETTINGS = dict(
    optimizer=[
        {"method": "adam", "iterations": 20, "learning_rate": 0.05},
        {"method": "lbfgs", "iterations": 40},
    ],
    uncertainty=False,
    progress=False,
    rtol=1e-8,
    atol=1e-8,
)
EVERY = 8
# On CPU in float64 the resumed run repeats the same compiled iterations on the
# same bits, so it agrees exactly; the issue asks for 1e-12.
RTOL = 1e-12

SCRIPT = """
import os, signal, sys
import jax
jax.config.update("jax_enable_x64", True)
import epifit
from epifit.fitting import _checkpoint

calls = 0

def hook(tmp):
    # called after half of the checkpoint has gone to its temporary file
    global calls
    calls += 1
    if calls == {kill_at}:
        open({marker!r}, "w").write(str(tmp))
        os.kill(os.getpid(), signal.SIGKILL)

if {kill_at}:
    _checkpoint._hook = hook
r = epifit.calibrate(
    {model!r}, {data!r}, checkpoint={ckpt!r}, checkpoint_every={every}, **{settings}
)
if {out!r}:
    import numpy as np

    np.savez(
        {out!r}, x=r.x, loss=r.loss, loss_history=r.loss_history,
        grad_norm_history=r.grad_norm_history, phase_history=r.phase_history,
        iterations=r.iterations, converged=r.converged, message=r.message,
    )
print("finished")
"""


def script(tmp_path, ckpt, kill_at: int, out: Path | None = None) -> Path:
    path = tmp_path / "run.py"
    path.write_text(
        textwrap.dedent(
            SCRIPT.format(
                kill_at=kill_at,
                marker=str(tmp_path / "killed"),
                model=str(MODEL),
                data=str(DATA),
                ckpt=None if ckpt is None else str(ckpt),
                every=EVERY,
                settings=repr(SETTINGS),
                out=None if out is None else str(out),
            )
        )
    )
    return path


class Reference:
    """The uninterrupted fit, run in its own process alongside the tests'
    (on two cores the two processes compile in parallel)."""

    def __init__(self, tmp_path: Path):
        self.out = tmp_path / "reference.npz"
        self.proc = subprocess.Popen(
            [sys.executable, str(script(tmp_path, None, 0, self.out))],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=tmp_path,
        )
        self._result = None

    def get(self) -> SimpleNamespace:
        if self._result is None:
            _, err = self.proc.communicate(timeout=600)
            assert self.proc.returncode == 0, err.decode()
            with np.load(self.out) as z:
                self._result = SimpleNamespace(**{k: z[k] for k in z.files})
        return self._result


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    ref = Reference(tmp_path_factory.mktemp("reference"))
    yield ref
    if ref.proc.poll() is None:
        ref.proc.kill()
        ref.proc.wait()


def assert_same(a, b):
    assert a.iterations == int(b.iterations)
    np.testing.assert_allclose(a.x, b.x, rtol=RTOL, atol=0)
    assert a.loss == pytest.approx(b.loss, rel=RTOL, abs=0)
    np.testing.assert_allclose(a.loss_history, b.loss_history, rtol=RTOL, atol=0)
    np.testing.assert_allclose(
        a.grad_norm_history, b.grad_norm_history, rtol=RTOL, atol=0
    )
    np.testing.assert_array_equal(a.phase_history, b.phase_history)
    assert a.converged == bool(b.converged) and a.message == str(b.message)


def test_resume_after_sigkill_mid_write(tmp_path, uninterrupted):
    ckpt = tmp_path / "FIT.ckpt"
    proc = subprocess.run(
        [sys.executable, str(script(tmp_path, ckpt, kill_at=3))],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    # killed with half a checkpoint in its temporary file: the previous one
    # (iteration 16) is intact
    partial = Path((tmp_path / "killed").read_text())
    assert partial.exists() and partial.stat().st_size > 0
    assert _checkpoint.checkpoint_phase(ckpt) == 0
    resumed = epifit.calibrate(
        MODEL, DATA, checkpoint=ckpt, checkpoint_every=EVERY, resume=True, **SETTINGS
    )
    assert not partial.exists()  # stale temporary files are cleaned up
    assert_same(resumed, uninterrupted.get())


def test_uninterrupted_run_needs_both_phases(uninterrupted):
    # the kill below (third checkpoint, iteration 24) falls in the L-BFGS phase
    ref = uninterrupted.get()
    assert int(ref.iterations) > 3 * EVERY
    assert set(ref.phase_history.tolist()) == {0, 1}


@pytest.mark.slow
def test_resume_after_sigkill_from_outside(tmp_path, uninterrupted):
    """Killed by another process at an arbitrary moment after the first
    checkpoint; resumed twice in a row (the second resume is a no-op)."""
    ckpt = tmp_path / "FIT.ckpt"
    proc = subprocess.Popen(
        [sys.executable, str(script(tmp_path, ckpt, kill_at=0))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=tmp_path,
    )
    deadline = time.monotonic() + 300
    while not ckpt.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    if not ckpt.exists():
        pytest.fail(f"no checkpoint was written: {proc.stderr.read().decode()}")
    resumed = epifit.calibrate(
        MODEL, DATA, checkpoint=ckpt, checkpoint_every=EVERY, resume=True, **SETTINGS
    )
    assert_same(resumed, uninterrupted.get())


def test_checkpoint_of_another_fit_is_refused(tmp_path):
    ckpt = tmp_path / "FIT.ckpt"
    one = dict(SETTINGS, optimizer=[{"method": "adam", "iterations": 4}])
    epifit.calibrate(MODEL, DATA, checkpoint=ckpt, checkpoint_every=2, **one)
    other = dict(one, rtol=1e-7)
    with pytest.raises(CheckpointError, match="belongs to a different fit"):
        epifit.calibrate(
            MODEL, DATA, checkpoint=ckpt, checkpoint_every=2, resume=True, **other
        )


def test_atomic_write_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    """An exception in the middle of a write leaves the previous checkpoint
    and no temporary file."""
    path = tmp_path / "x.ckpt"
    carry = {"a": jnp.arange(3.0), "b": jnp.ones((2, 2), jnp.int32)}
    record = {
        "history": {"loss": [np.arange(4.0)]},
        "initial_loss": np.array([1.0]),
        "phase": 0,
        "phase_iteration": 4,
        "iteration": 4,
        "elapsed": 0.1,
        "statuses": [],
    }
    _checkpoint.save_checkpoint(path, carry, record, "key")
    before = path.read_bytes()

    def boom(tmp):
        raise KeyboardInterrupt

    monkeypatch.setattr(_checkpoint, "_hook", boom)
    record2 = dict(record, iteration=8)
    with pytest.raises(KeyboardInterrupt):
        _checkpoint.save_checkpoint(path, carry, record2, "key")
    assert path.read_bytes() == before
    assert list(tmp_path.iterdir()) == [path]
    monkeypatch.setattr(_checkpoint, "_hook", None)
    template = {"a": jnp.zeros(3), "b": jnp.zeros((2, 2), jnp.int32)}
    back = _checkpoint.load_checkpoint(path, template, "key")
    np.testing.assert_array_equal(back["carry"]["a"], carry["a"])
    assert back["record"]["iteration"] == 4
    with pytest.raises(CheckpointError, match="different fit"):
        _checkpoint.load_checkpoint(path, template, "other")
    os.truncate(path, 10)
    with pytest.raises(CheckpointError, match="Cannot read checkpoint"):
        _checkpoint.load_checkpoint(path, template, "key")


def test_multistart_resume_after_time_budget_is_exact(tmp_path):
    """Three starts (on CPU run one after another in each compiled chunk):
    stopped by the time budget after the first chunk, then resumed, the fit
    ends where an uninterrupted one does, bit for bit."""
    settings = dict(
        optimizer=[{"method": "adam", "iterations": 12, "learning_rate": 0.05}],
        n_starts=3,
        seed=2,
        uncertainty=False,
        progress=False,
        rtol=1e-8,
        atol=1e-8,
        chunk_size=4,
    )
    ref = epifit.calibrate(MODEL, DATA, **settings)
    ckpt = tmp_path / "fit.ckpt.nc"
    part = epifit.calibrate(
        MODEL, DATA, checkpoint=ckpt, checkpoint_every=4, time_budget=1e-6, **settings
    )
    assert part.iterations == 4 and "time budget" in part.message
    res = epifit.calibrate(
        MODEL, DATA, checkpoint=ckpt, checkpoint_every=4, resume=True, **settings
    )
    assert res.iterations == ref.iterations == 12
    np.testing.assert_array_equal(res.start_losses, ref.start_losses)
    np.testing.assert_array_equal(res.x, ref.x)
    np.testing.assert_array_equal(res.loss_history, ref.loss_history)
    assert len(set(np.round(ref.initial_losses, 6))) == 3


def test_an_optax_phase_resumes_exactly(tmp_path):
    """A phase given as an optax transformation is checkpointed like Adam: a
    fresh but equal transformation resumes the fit (its fingerprint names the
    phase's kind, not the functions' addresses) to the same bits."""
    import optax

    settings = dict(
        uncertainty=False, progress=False, rtol=1e-8, atol=1e-8, chunk_size=4
    )

    def phases():
        return [{"method": optax.adam(0.05), "iterations": 12}]

    ref = epifit.calibrate(MODEL, DATA, optimizer=phases(), **settings)
    ckpt = tmp_path / "fit.ckpt.nc"
    part = epifit.calibrate(
        MODEL,
        DATA,
        optimizer=phases(),
        checkpoint=ckpt,
        checkpoint_every=4,
        time_budget=1e-6,
        **settings,
    )
    assert part.iterations == 4 and "time budget" in part.message
    res = epifit.calibrate(
        MODEL,
        DATA,
        optimizer=phases(),
        checkpoint=ckpt,
        checkpoint_every=4,
        resume=True,
        **settings,
    )
    assert res.iterations == ref.iterations == 12
    np.testing.assert_array_equal(res.x, ref.x)
    np.testing.assert_array_equal(res.loss_history, ref.loss_history)
