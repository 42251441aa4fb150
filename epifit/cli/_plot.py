"""`epifit plot FIT.nc --out fig.png`: fits (or simulations) against data."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import epifit.cli._flags as _flags
from epifit._paths import output_file, output_lock


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "file",
        help="a fit (epifit calibrate), simulation, forecast or profile file (netCDF)",
    )
    p.add_argument("--out", required=True, help="figure file (.png, .pdf or .svg)")
    p.add_argument(
        "--patches",
        help="comma-separated patch labels to draw (default: all, or the largest)",
    )
    p.add_argument(
        "--max-patches",
        type=_flags.count,
        default=12,
        help="the most patches drawn when --patches is not given (default 12)",
    )
    p.add_argument(
        "--samples",
        type=_flags.integer(0),
        default=100,
        help="a fit's predictive bands: parameter draws from its Laplace "
        "approximation, each with its observation noise (default 100; 0: the "
        "noise at the fitted mean only, no model run)",
    )
    p.add_argument(
        "--seed", type=_flags.seed, default=0, help="seed of the draws (default 0)"
    )


def _run(a) -> int:
    from epifit.plotting import plot_fit

    src = Path(a.file)
    if not src.exists():
        raise FileNotFoundError(f"File {src} does not exist.")
    out = output_file(a.out, inputs=fit_inputs(src))
    patches = (
        [p.strip() for p in a.patches.split(",") if p.strip()] if a.patches else None
    )
    with output_lock(out):
        kind = _kind(src)
        # -- forecasts (epifit.forecasting): fan charts per scenario ----------
        if kind == "forecast":
            from epifit.forecasting import plot_forecast

            plot_forecast(src, out, patches=patches)
        elif kind == "profile":  # epifit profile: the profile and its cut
            from epifit.fitting import plot_profile

            plot_profile(src, out)
        else:
            plot_fit(
                src,
                out,
                patches=patches,
                max_patches=a.max_patches,
                samples=a.samples,
                seed=a.seed,
            )
    print(f"wrote {a.out}")
    return 0


def fit_inputs(path: Path) -> dict[str, str]:
    """What a command reading a fit, forecast, simulation or posterior file
    reads: the file and the data file its attributes name (`data_file`,
    relative to where it was written, and `data_file_absolute` where stored;
    a posterior's in its `fit` group)."""
    import netCDF4

    inputs = {"the input file": str(path)}
    try:
        with netCDF4.Dataset(path) as nc:
            # a posterior file (epifit sample) names its data in its fit group
            attrs = nc.groups["fit"] if "fit" in nc.groups else nc
            for key in ("data_file", "data_file_absolute"):
                name = getattr(attrs, key, "")
                if isinstance(name, str) and name and os.path.exists(name):
                    inputs[f"the data file it names ({key})"] = name
    except (OSError, ValueError, RuntimeError):
        pass  # the reader reports unreadable files
    return inputs


def _kind(path: Path) -> str | None:
    """A netCDF file's `epifit_kind` (`forecast`, `profile`; None for fits
    and simulations)."""
    import netCDF4

    try:
        with netCDF4.Dataset(path) as nc:
            return getattr(nc, "epifit_kind", None)
    except OSError:
        return None  # plot_fit reports unreadable files


COMMAND = (
    "draw a fit or simulation against its data, a forecast's fans or a "
    "profile (PNG/PDF/SVG)",
    _add_arguments,
    _run,
)
