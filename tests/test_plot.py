"""`epifit plot` and `epifit.plotting`: figures of fits and simulations."""

from pathlib import Path

import numpy as np
import pytest

import epifit
from epifit.cli import main
from epifit.plotting import plot_fit, select_patches

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "models" / "sir.toml"
DATA = REPO / "data" / "boarding_school_1978.nc"
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _no_persistent_cache(monkeypatch):
    monkeypatch.setenv("EPIFIT_NO_CACHE", "1")


@pytest.fixture(scope="module")
def fit_file(tmp_path_factory):
    res = epifit.calibrate(MODEL, DATA, progress=False)
    return res.to_netcdf(tmp_path_factory.mktemp("fit") / "FIT.nc")


def is_png(path: Path) -> bool:
    return path.exists() and path.stat().st_size > 1000 and path.read_bytes()[:8] == PNG


def test_plot_a_fit(fit_file, tmp_path, capsys):
    out = tmp_path / "fit.png"
    # --samples 0: no draws, no model run (least squares: no bands at all)
    assert main(["plot", str(fit_file), "--out", str(out), "--samples", "0"]) == 0
    assert is_png(out)
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    # the predictive bands of the Gauss-Newton fit: 20 parameter draws
    fig = plot_fit(fit_file, samples=20)
    titles = [ax.get_title() for ax in fig.axes]
    assert "in_bed — p0" in titles and "loss history" in titles
    legend = " ".join(fig.legends[0].get_title().get_text().split())
    # least squares has no noise model: the bands are over the draws only
    assert "(in_bed, R_eff: 20 parameter draws only)" in legend
    ax = fig.axes[titles.index("in_bed — p0")]
    assert len(ax.collections) == 2  # the 95% and 50% bands
    # the fitted curve lies inside the 95% band of the draws around it
    fitted = epifit.open_dataset(fit_file)["predicted_in_bed"].values[:, 0]
    (outer_lo, outer_hi) = _band_edges(ax.collections[0], fitted.size)
    assert np.all(outer_lo <= fitted + 1e-9) and np.all(fitted <= outer_hi + 1e-9)
    assert np.all(outer_hi - outer_lo > 0)
    reff = fig.axes[titles.index("R_eff — p0")]
    assert len(reff.collections) == 2
    # the residual panel under the data: Pearson, scaled by the Gauss-Newton s
    (res,) = [a for a in fig.axes if "residual" in a.get_ylabel()]
    assert res.get_shared_x_axes().joined(res, ax)


def _band_edges(band, n: int):
    """The lower and upper edges of a `fill_between` over `n` days."""
    v = band.get_paths()[0].vertices[:, 1]
    # fill_between's path: start, the upper edge forwards, the lower backwards
    upper = v[1 : n + 1]
    lower = v[n + 2 : 2 * n + 2][::-1]
    return np.minimum(lower, upper), np.maximum(lower, upper)


def test_plot_a_simulation_with_patches(tmp_path, capsys):
    sim = tmp_path / "sim.nc"
    argv = ["simulate", str(MODEL), "--out", str(sim), "--days", "30"]
    assert main([*argv, "--patches", "3"]) == 0
    out = tmp_path / "sim.png"
    assert main(["plot", str(sim), "--out", str(out), "--patches", "p0,p2"]) == 0
    assert is_png(out)
    fig = plot_fit(sim, patches=["p0", "p2"])
    titles = ["in_bed — p0", "in_bed — p2", "R_eff — p0", "R_eff — p2"]
    assert [ax.get_title() for ax in fig.axes] == titles
    chosen, note = select_patches(epifit.open_dataset(sim), max_patches=2)
    assert len(chosen) == 2 and note == "2 of 3 patches (largest)"
    capsys.readouterr()
    assert main(["plot", str(sim), "--out", str(out), "--patches", "p0,zz"]) == 2
    err = capsys.readouterr().err
    assert "Unknown patch(es) ['zz']; the file has 3 patches: p0, p1, p2" in err


def test_plot_missing_file(tmp_path, capsys):
    assert (
        main(["plot", str(tmp_path / "no.nc"), "--out", str(tmp_path / "a.png")]) == 2
    )
    assert "does not exist" in capsys.readouterr().err
