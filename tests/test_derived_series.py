"""`[derived]` expressions that read compartment totals or covariates are
derived *series* (issue 20, item 3): evaluated along the trajectory and
written as `(time, patch)` variables by simulate and into FIT.nc; other
expressions may not use them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import xarray as xr
from test_cookbook import vaccination_dataset

import epifit
from epifit.model import ModelSpecError, loads_model

REPO = Path(__file__).resolve().parents[1]

TEXT = (
    (REPO / "models" / "seir_vaccination.toml")
    .read_text()
    .replace(
        "[covariates]",
        '[derived]\nprevalence = "I / N"\n'
        'per_dose = "prevalence * 1000 / (doses + 1)"\nR0 = "beta / gamma"\n\n'
        "[covariates]",
    )
)


def test_series_are_evaluated_along_the_trajectory():
    spec = loads_model(TEXT, path="vs.toml")
    assert [d.name for d in spec.series] == ["prevalence", "per_dose"]
    assert [d.name for d in spec.derived] == ["R0"]  # a quantity, not a series
    ds = vaccination_dataset()
    out = epifit.simulate(spec, ds)
    assert out["prevalence"].dims == ("time", "patch")
    i = out["I"].values[:, 0]
    np.testing.assert_allclose(out["prevalence"].values[:, 0], i / 1e5, rtol=1e-12)
    want = i / 1e5 * 1000 / (ds["doses"].values + 1)
    np.testing.assert_allclose(out["per_dose"].values[:, 0], want, rtol=1e-12)


def test_fit_files_carry_the_series(tmp_path):
    spec = loads_model(TEXT, path="vs.toml")
    ds = vaccination_dataset()
    out = epifit.simulate(spec, ds)
    for name in ("cases", "vaccinated"):  # the model's own expected counts
        ds[name] = ("time", np.round(out[f"predicted_{name}"].values[:, 0]))
    fit = epifit.calibrate(
        spec, ds, max_iterations=2, uncertainty=False, progress=False
    )
    fit.to_netcdf(tmp_path / "FIT.nc")
    with xr.open_dataset(tmp_path / "FIT.nc") as f:
        np.testing.assert_allclose(
            f["prevalence"].values, f["I"].values / 1e5, rtol=1e-12
        )


def test_a_series_cannot_feed_another_expression():
    bad = TEXT.replace('rate = "sigma"', 'rate = "sigma * (1 + prevalence)"', 1)
    with pytest.raises(
        ModelSpecError,
        match=r"'prevalence' \(a derived series\) "
        r"cannot be used in a rate",
    ):
        loads_model(bad, path="b.toml")
