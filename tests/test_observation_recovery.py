"""Recovery of reporting parameters (issue 19): an SEIR whose cases have a gamma
reporting delay (mean 5 days), a day-of-week effect and 60% ascertainment,
simulated with `epifit simulate --observe negative_binomial` and fitted back
with `epifit calibrate`. The infectious period is held at its value (1 / gamma
= 5 days, as the model file has it): from case counts alone, R0 and gamma are
told apart only by the epidemic's final size, which the ascertainment blurs
(with gamma free, R0 came out 11% high on one seed of four)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import xarray as xr

from epifit.cli import main

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "models" / "seir_reporting.toml"
TRUTH = {
    "beta": 0.5,
    "gamma": 0.2,
    "rho": 0.6,
    "delay_mean": 5.0,
    "phi": 20.0,
    "dow_mon": 0.25,
    "dow_tue": 0.1,
    "dow_wed": 0.05,
    "dow_thu": 0.0,
    "dow_fri": -0.05,
    "dow_sat": -0.15,
}


@pytest.mark.slow
def test_delay_week_effect_and_ascertainment_are_recovered(tmp_path, capsys):
    days = 150
    time = pd.date_range("2021-03-01", periods=days)
    testing = 1.0 + 0.2 * np.sin(np.arange(days) / 9.0)
    xr.Dataset({"testing": ("time", testing)}, coords={"time": time}).to_netcdf(
        tmp_path / "testing.nc"
    )
    (tmp_path / "truth.toml").write_text(
        "".join(f"{k} = {v!r}\n" for k, v in TRUTH.items())
    )
    argv = ["simulate", str(MODEL), "--data", str(tmp_path / "testing.nc")]
    argv += ["--params", str(tmp_path / "truth.toml"), "--observe", "negative_binomial"]
    argv += ["--seed", "1", "--out", str(tmp_path / "sim.nc")]
    assert main(argv) == 0
    capsys.readouterr()
    with xr.open_dataset(tmp_path / "sim.nc") as ds:
        cases = ds["cases"].values
        assert np.isnan(cases[0]).all() and np.isfinite(cases[1:]).all()
        assert np.array_equal(cases[1:], np.round(cases[1:]))
    (tmp_path / "fit.toml").write_text("[parameters]\ngamma = { fixed = true }\n")
    argv = ["calibrate", str(MODEL), "--data", str(tmp_path / "sim.nc")]
    argv += ["--fit", str(tmp_path / "fit.toml")]
    argv += ["--out", str(tmp_path / "FIT.nc"), "--no-progress", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    fitted = out["parameters"]
    assert fitted["delay_mean"] == pytest.approx(5.0, rel=0.1)
    assert fitted["rho"] == pytest.approx(0.6, rel=0.1)
    assert fitted["R0"] == pytest.approx(2.5, rel=0.1)
    # the truth lies within three standard errors of every estimate (the week
    # effects' are about 0.05 at this noise)
    with xr.open_dataset(tmp_path / "FIT.nc") as fit:
        labels = [str(v) for v in fit["estimate"][fit["estimate"].dims[0]].values]
        estimate = dict(zip(labels, fit["estimate"].values, strict=True))
        se = dict(zip(labels, fit["se"].values, strict=True))
    for name, want in TRUTH.items():
        assert abs(estimate[name] - want) <= 3 * se[name], name
