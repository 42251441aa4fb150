"""Draw the figures of the docs' Figures page (`docs/figures.md`) from the
bundled boarding-school data: run from the repository root,

    python docs/figures/make_figures.py

It fits an SIR with a Poisson likelihood (`models/sir.toml` with `family =
"poisson"`) and its Laplace approximation, then writes

- `fit.png`: the fit with its predictive bands (parameter draws and Poisson
  noise), Pearson residuals, R_eff(t) with its band, the loss history;
- `fan.png`: a forecast of three scenarios (the fit, beta halved from day 5,
  beta doubled from day 8: counterfactuals inside the data's window) with
  R_eff(t);
- `profile.png`: the profile likelihood of gamma with the Laplace interval.

About three minutes on two CPU cores; the PNGs are committed.
"""

import tempfile
from pathlib import Path

import jax

jax.config.update("jax_enable_x64", True)

import epifit  # noqa: E402
from epifit.fitting import plot_profile, profile  # noqa: E402
from epifit.forecasting import forecast, plot_forecast  # noqa: E402
from epifit.plotting import plot_fit  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
DPI = 96  # legible, and small enough to commit (~100 KB each)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        text = (REPO / "models" / "sir.toml").read_text()
        model = Path(tmp) / "sir_poisson.toml"
        model.write_text(text.replace('"least_squares"', '"poisson"'))
        data = REPO / "data" / "boarding_school_1978.nc"
        fit = epifit.calibrate(model, data, progress=False)
        path = fit.to_netcdf(Path(tmp) / "FIT.nc")
        fig = plot_fit(path, samples=200, seed=0)
        fig.savefig(HERE / "fit.png", dpi=DPI)
        half = {"parameter": "beta", "scale": 0.5, "start": 5}
        double = {"parameter": "beta", "scale": 2.0, "start": 8}
        scenarios = {  # as a scenario file's TOML reads
            "scenarios": {
                "beta_half_day5": {"description": "beta x 0.5", "changes": [half]},
                "beta_double_day8": {"description": "beta x 2", "changes": [double]},
            }
        }
        fc = forecast(path, scenarios, days=14, samples=200, seed=0)
        plot_forecast(fc).savefig(HERE / "fan.png", dpi=DPI)
        prof = profile(path, "gamma", points=15)
        plot_profile(prof).savefig(HERE / "profile.png", dpi=DPI)
    for name in ("fit", "fan", "profile"):
        print(f"wrote {HERE / name}.png")


if __name__ == "__main__":
    main()
