"""Non-finite losses and gradients: reject, retreat, stop with the last good
state; multi-start on a function with two minima."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import epifit
from epifit.fitting._chunk import GRADIENT, LOSS, NONFINITE
from epifit.fitting._config import PhaseConfig
from epifit.fitting._optimize import OptimizeOptions, Optimizer

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data" / "boarding_school_1978.nc"
ADAM = PhaseConfig("adam", 200, options=(("learning_rate", 0.3),))
LBFGS = PhaseConfig("lbfgs", 200)
LM = PhaseConfig("levenberg_marquardt", 200)


class Toy:
    """The objective interface of the optimiser for a plain function of `x`
    with residuals `r(x)` (`loss = sum(r ** 2)`)."""

    def __init__(self, residuals):
        self.r = residuals

    def loss(self, x, data):
        return jnp.sum(jnp.square(self.r(x)))

    def value_and_grad(self, x, data):
        return jax.value_and_grad(self.loss)(x, data)

    def jacobian_and_solution(self, x, data):
        r = self.r(x)
        return r, jax.jacfwd(self.r)(x), None, None, None

    def residuals_and_jacobian(self, x, data):
        return self.r(x), jax.jacfwd(self.r)(x)

    def compiled(self, name):
        return jax.jit(jax.vmap(getattr(self, name), in_axes=(0, None)))


def run(residuals, phase, x0, **options):
    opt = Optimizer(Toy(residuals), [phase], OptimizeOptions(**options))
    return opt.run(jnp.asarray(x0, float), None)


@pytest.mark.parametrize("phase", [ADAM, LBFGS, LM], ids=lambda p: p.method)
def test_nan_everywhere_but_the_start_stops_with_the_start(phase):
    x0 = np.array([[0.5, 0.5]])

    def r(x):
        return jnp.where(jnp.all(x == 0.5), x - 3.0, jnp.nan)

    out = run(r, phase, x0, max_retreats=5)
    carry = out["carry"]
    np.testing.assert_array_equal(carry.x, x0)  # the last good state
    assert float(carry.f[0]) == 12.5
    assert out["record"]["statuses"] == [[NONFINITE]]
    assert out["record"]["iteration"] == 5  # five rejected steps in a row


@pytest.mark.parametrize("phase", [ADAM, LBFGS, LM], ids=lambda p: p.method)
def test_nan_region_is_never_entered(phase):
    """The minimum (3, 3) lies in a region where the loss is NaN (x0 >= 1):
    every accepted point stays outside it, at a finite loss."""

    def r(x):
        return jnp.where(x[0] < 1.0, x - 3.0, jnp.nan)

    out = run(r, phase, [[0.0, 0.0]], max_retreats=8)
    carry, hist = out["carry"], out["record"]["history"]
    assert float(carry.x[0, 0]) < 1.0
    assert np.isfinite(float(carry.f[0]))
    assert np.all(np.isfinite(hist["loss"][0]))
    assert float(carry.f[0]) < 18.0  # it did make progress from (0, 0)


def test_multistart_finds_both_minima_independently():
    """A double well: each start converges in its own basin (vmap keeps the
    starts independent); the lower minimum is near x = -1."""

    def r(x):
        return jnp.stack([x[0] ** 2 - 1.0, jnp.sqrt(0.05) * (x[0] + 2.0)])

    out = run(r, LBFGS, [[0.9], [-0.9], [3.0]], tolerance=1e-10)
    x = np.asarray(out["carry"].x)[:, 0]
    f = np.asarray(out["carry"].f)
    assert x[0] > 0.5 and x[1] < -0.5
    assert int(np.argmin(f)) in (1, 2) and f[1] < f[0]
    assert all(s in (GRADIENT, LOSS) for s in out["record"]["statuses"][0])


def test_model_with_a_nan_region_returns_last_good_state(tmp_path):
    """SIR whose recovery rate is NaN for beta > 1.7 (a `sqrt` of a negative
    number), fitted to the boarding school, whose least-squares beta (1.79)
    lies in that region: Adam walks to the edge, its steps into the region are
    rejected, and after `max_retreats` rejections in a row the fit stops with
    the last good state and says why."""
    text = (REPO / "models" / "sir.toml").read_text()
    model = tmp_path / "sir_nan.toml"
    model.write_text(
        text.replace('rate = "gamma"', 'rate = "gamma + 0 * sqrt(1.7 - beta)"')
    )
    with pytest.warns(RuntimeWarning, match="non-finite for 4 retreats in a row"):
        res = epifit.calibrate(
            model,
            DATA,
            optimizer={"method": "adam", "iterations": 100, "learning_rate": 0.05},
            fit={"max_retreats": 4},
            values={"beta": 1.2},
            uncertainty=False,
            progress=False,
        )
    assert not res.converged
    assert "returning the last good state" in res.message
    assert 1.6 < res.parameters["beta"] < 1.7
    traj = res.trajectories
    residual = traj["observed_in_bed"] - traj["predicted_in_bed"]
    assert res.loss == pytest.approx(float(np.square(residual).sum()), rel=1e-9)
    assert np.all(np.isfinite(res.loss_history))
    assert res.loss == pytest.approx(res.loss_history[-1])


def test_non_finite_start_is_an_error(tmp_path):
    text = (REPO / "models" / "sir.toml").read_text()
    model = tmp_path / "sir_nan.toml"
    model.write_text(
        text.replace('rate = "gamma"', 'rate = "gamma + 0 * sqrt(1.7 - beta)"')
    )
    with pytest.raises(FloatingPointError, match="not finite at every starting"):
        epifit.calibrate(model, DATA, optimizer="adam", progress=False)


@pytest.mark.parametrize(
    "phases",
    [[ADAM], [LBFGS], [LM], [ADAM, LBFGS]],
    ids=lambda ps: "+".join(p.method for p in ps),
)
def test_each_phase_compiles_its_chunk_once(phases):
    """Chunks after the first reuse the first's executable: the phase's
    initial state has the types the chunk returns (optax's L-BFGS starts its
    line-search info weakly typed, which once compiled every L-BFGS chunk
    function twice); Adam then L-BFGS run the one program of both."""
    rosenbrock = lambda x: jnp.stack([10 * (x[1] - x[0] ** 2), 1 - x[0]])  # noqa: E731
    opt = Optimizer(
        Toy(rosenbrock), phases, OptimizeOptions(tolerance=1e-12, chunk_size=3)
    )
    out = opt.run(jnp.asarray([[-1.2, 1.0], [0.5, 0.5]]), None)
    assert out["record"]["iteration"] > 6  # several chunks ran
    assert out["record"]["phase"] == len(phases)
    assert opt._chunk_fn(len(phases) - 1) is opt._chunk_fn(0)
    assert opt._chunk_fn(0)._cache_size() == 1
