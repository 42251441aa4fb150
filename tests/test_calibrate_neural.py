"""Per-patch parameters and neural sub-models in a fit: what moves, what does
not, labels, and the round trip of an MLP through FIT.nc."""

from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest
import xarray as xr
from helpers import tree_allclose

import epifit
from epifit.fitting import FitResult

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "models" / "seird_metapop_mobility.toml"
N_PATCH, DAYS = 3, 25


def dataset() -> xr.Dataset:
    rng = np.random.default_rng(0)
    patches = ["north", "east", "south"]
    mobility = rng.uniform(0.2, 0.8, (DAYS, N_PATCH, 7))
    coupling = rng.uniform(0.0, 0.05, (DAYS, N_PATCH, N_PATCH))
    e0 = np.array([1e-3, 0.0, 5e-4])
    data = {
        "mobility": (("time", "patch", "feature"), mobility),
        "coupling": (("time", "patch", "patch_to"), coupling),
        "initial_S": ("patch", 1.0 - e0),
        "initial_E": ("patch", e0),
        "initial_ID": (("stage_ID", "patch"), np.zeros((7, N_PATCH))),
        "initial_D": ("patch", np.zeros(N_PATCH)),
        "initial_IR": (("stage_IR", "patch"), np.zeros((5, N_PATCH))),
        "initial_R": ("patch", np.zeros(N_PATCH)),
        # arbitrary positive series: this test is about plumbing, not accuracy
        "new_infections": (("time", "patch"), rng.uniform(1e-4, 1e-3, (DAYS, 3))),
        "new_deaths": (("time", "patch"), rng.uniform(1e-6, 1e-5, (DAYS, 3))),
    }
    return xr.Dataset(
        data, coords={"time": np.arange(DAYS), "patch": patches, "patch_to": patches}
    )


def adam_fit(ds: xr.Dataset, parameters: dict, iterations: int):
    """A few Adam iterations of the model on `ds` with these overrides."""
    return epifit.calibrate(
        MODEL,
        ds,
        fit={"parameters": parameters},
        optimizer={"method": "adam", "iterations": iterations, "learning_rate": 0.01},
        uncertainty=False,
        progress=False,
        rtol=1e-5,
        atol=1e-8,
    )


@pytest.mark.slow
def test_mlp_and_per_patch_fit_round_trip(tmp_path):
    ds = dataset()
    res = adam_fit(ds, {"kappa": {"fixed": True}, "beta": {"l2": 1e-3}}, 5)
    start = epifit.Problem(MODEL, ds).init_params()
    # fixed: exactly the model's value; free scalars, per-patch values and MLP
    # weights all moved
    assert float(res.params["kappa"]) == float(start["kappa"])
    assert float(res.params["alpha"]) != float(start["alpha"])
    assert np.all(np.asarray(res.params["scaler"]) != np.asarray(start["scaler"]))
    w0 = start["beta"].layers[0].weight
    assert not np.allclose(res.params["beta"].layers[0].weight, w0)
    assert res.params["beta"].activation is start["beta"].activation
    n_mlp = sum(
        x.size for x in jax.tree.leaves(eqx.filter(start["beta"], eqx.is_array))
    )
    assert len(res.labels) == 2 + N_PATCH + n_mlp  # alpha, gamma, scaler, MLP
    assert "scaler[east]" in res.labels and "beta.layers[0].weight[0,0]" in res.labels
    assert "kappa" not in res.labels and "kappa" in res.coefficient_labels
    assert res.parameters["scaler"] == pytest.approx(
        list(np.log1p(np.exp(np.asarray(res.params["scaler"])))), rel=1e-12
    )
    assert isinstance(res.to_json()["parameters"]["scaler"], list)
    assert "beta" not in res.parameters  # neural sub-models are not values

    # FIT.nc holds every coefficient; the MLP comes back from the model text
    path = res.to_netcdf(tmp_path / "FIT.nc")
    back = FitResult.from_netcdf(path, data=ds)
    assert tree_allclose(
        eqx.filter(back.params, eqx.is_array), eqx.filter(res.params, eqx.is_array)
    )
    assert back.parameters == res.parameters
    sol = back.problem.solve(back.params, rtol=1e-5, atol=1e-8)
    pred = back.problem.predict(back.params, sol.ys)["new_deaths"]
    np.testing.assert_allclose(
        pred, res.trajectories["predicted_new_deaths"].values[1:], rtol=1e-10
    )


def test_fit_moves_only_the_output_layer_of_hidden_fixed_mlp(tmp_path):
    """`fixed = "hidden"` in the fit file: the hidden layers keep the model's
    values exactly, the output layer's weights and bias move, and only they
    are labelled among the free entries; the fit file's setting comes back
    with FIT.nc."""
    ds = dataset()
    res = adam_fit(ds, {"beta": {"fixed": "hidden"}}, 3)
    start = epifit.Problem(MODEL, ds).init_params()["beta"]
    got = res.params["beta"]
    for i in range(len(start.layers) - 1):
        np.testing.assert_array_equal(got.layers[i].weight, start.layers[i].weight)
        np.testing.assert_array_equal(got.layers[i].bias, start.layers[i].bias)
    last = len(start.layers) - 1
    assert not np.allclose(got.layers[-1].weight, start.layers[-1].weight)
    assert not np.allclose(got.layers[-1].bias, start.layers[-1].bias)
    mlp = [s for s in res.labels if s.startswith("beta")]
    width = start.layers[-1].weight.shape[1]
    assert len(mlp) == width + 1
    assert all(s.startswith(f"beta.layers[{last}].") for s in mlp)
    back = FitResult.from_netcdf(res.to_netcdf(tmp_path / "FIT.nc"), data=ds)
    assert back.labels == res.labels
