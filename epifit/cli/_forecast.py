"""`epifit forecast FIT.nc|POSTERIOR.nc --scenarios SCENARIOS.toml --days N
--out FORECAST.nc`."""

from __future__ import annotations

import argparse

import epifit.cli._flags as _flags
from epifit._paths import existing_file, output_file, output_lock
from epifit.cli._json import dumps
from epifit.cli._plot import fit_inputs
from epifit.cli._stored import programs_kept


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "fit",
        help="a fit file (epifit calibrate), FIT.nc, or a posterior file (epifit "
        "sample), POSTERIOR.nc: its draws with the fit it embeds",
    )
    p.add_argument(
        "--scenarios",
        help="scenario file (TOML); default: the baseline only",
    )
    p.add_argument("--out", required=True, help="output forecast file (netCDF)")
    p.add_argument(
        "--days",
        type=_flags.integer(0),
        help="forecast days past the data (default: the scenario file's `days`)",
    )
    p.add_argument(
        "--samples",
        type=_flags.integer(0),
        default=100,
        help="parameter draws from the fit's Laplace approximation, or from the "
        "posterior (default 100; 0: the point estimate only)",
    )
    p.add_argument(
        "--seed", type=_flags.seed, default=0, help="seed of the draws (default 0)"
    )
    p.add_argument(
        "--quantiles",
        type=_flags.levels,
        help="comma-separated levels (default 0.025,0.25,0.5,0.75,0.975)",
    )
    p.add_argument(
        "--compartments",
        help="comma-separated compartments to report besides the observed series",
    )
    p.add_argument(
        "--data",
        help="the fit's dataset, when the data file named in FIT.nc (or "
        "POSTERIOR.nc) moved",
    )
    p.add_argument(
        "--chunk-size",
        type=_flags.count,
        help="samples per compiled call (default by memory)",
    )
    p.add_argument(
        "--no-observation-noise",
        action="store_true",
        help="bands of the observed series over the parameter draws only (the "
        "expected observations); default: draws and each observation's noise "
        "(poisson, negative binomial, gaussian), the band new data fall in",
    )
    p.add_argument(
        "--posterior",
        help="draw the parameters from this posterior (epifit sample's "
        "POSTERIOR.nc, over the fit's free parameters) instead of the Laplace "
        "approximation; not with a POSTERIOR.nc in place of FIT.nc",
    )
    p.add_argument("--json", action="store_true", help="print a JSON summary")


def _list(text: str | None) -> list[str]:
    return [x.strip() for x in (text or "").split(",") if x.strip()]


def _run(a) -> int:
    from epifit.data import write_dataset
    from epifit.forecasting import DEFAULT_QUANTILES, forecast, forecast_summary

    fit = existing_file(a.fit, "Fit")
    scenarios = existing_file(a.scenarios, "Scenario") if a.scenarios else ()
    data = existing_file(a.data, "Data") if a.data else None
    post = existing_file(a.posterior, "Posterior") if a.posterior else None
    inputs = {"--scenarios": scenarios or None, "--data": data, **fit_inputs(fit)}
    inputs["--posterior"] = post
    out = output_file(a.out, inputs=inputs)
    with output_lock(out), programs_kept(a):
        ds = forecast(
            fit,
            scenarios,
            days=a.days,
            samples=a.samples,
            seed=a.seed,
            quantiles=a.quantiles or DEFAULT_QUANTILES,
            compartments=_list(a.compartments),
            data=data,
            chunk_size=a.chunk_size,
            observation_noise=not a.no_observation_noise,
            posterior=post,
        )
        ds.attrs["command"] = " ".join(
            ["epifit forecast", a.fit]
            + ([f"--scenarios {a.scenarios}"] if a.scenarios else [])
            + [f"--days {ds.attrs['days']}", f"--samples {a.samples}"]
            + [f"--seed {a.seed}", f"--out {a.out}"]
            + (["--no-observation-noise"] if a.no_observation_noise else [])
            + ([f"--posterior {a.posterior}"] if a.posterior else [])
        )
        write_dataset(ds, out)
    summary = forecast_summary(ds)
    summary["out"] = str(out)
    if a.json:
        print(dumps(summary))
        return 0
    levels = summary["quantiles"]
    lo, hi = f"{levels[0]:g}", f"{levels[-1]:g}"
    med = "0.5" if 0.5 in levels else f"{levels[len(levels) // 2]:g}"
    print(
        f"forecast of '{summary['model']}': {summary['days']} days from "
        f"{summary['forecast_start']}, {summary['samples']} draws (seed "
        f"{summary['seed']}); totals over patches, {med} quantile [{lo}, {hi}]"
    )
    noise = {k: v for k, v in summary["observation_noise"].items() if v != "none"}
    print(
        "observation noise: "
        + (", ".join(f"{k} {v}" for k, v in noise.items()) or "none")
        + " (on top of the draws, in the observed series' quantiles)"
    )
    for name, rec in summary["scenarios"].items():
        failed = rec.pop("failed_samples")
        note = f"  ({failed} draws failed)" if failed else ""
        print(f"{name}{note}")
        for s, stats in rec.items():
            parts = [
                f"{stat} {stats[stat][med]:.4g} [{stats[stat][lo]:.4g}, "
                f"{stats[stat][hi]:.4g}]"
                for stat in ("cumulative", "peak", "peak_day")
            ]
            print(f"  {s:20s} " + "; ".join(parts))
    print(f"wrote {out}")
    return 0


COMMAND = (
    "run scenarios over a fit's uncertainty; write FORECAST.nc (quantiles, peaks)",
    _add_arguments,
    _run,
)
