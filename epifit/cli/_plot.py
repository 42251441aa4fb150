"""`epifit plot FIT.nc --out fig.png`: fits (or simulations) against data."""

from __future__ import annotations

import argparse
from pathlib import Path


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="a fit (epifit calibrate) or simulation file (netCDF)")
    p.add_argument("--out", required=True, help="figure file (.png, .pdf or .svg)")
    p.add_argument(
        "--patches",
        help="comma-separated patch labels to draw (default: all, or the largest)",
    )
    p.add_argument(
        "--max-patches",
        type=int,
        default=12,
        help="the most patches drawn when --patches is not given (default 12)",
    )


def _run(a) -> int:
    from epifit.plotting import plot_fit

    src = Path(a.file)
    if not src.exists():
        raise FileNotFoundError(f"File {src} does not exist.")
    if a.max_patches < 1:
        raise ValueError(f"--max-patches must be >= 1; got {a.max_patches}")
    patches = (
        [p.strip() for p in a.patches.split(",") if p.strip()] if a.patches else None
    )
    # -- forecasts (epifit.forecasting): fan charts per scenario --------------
    if _is_forecast(src):
        from epifit.forecasting import plot_forecast

        plot_forecast(src, a.out, patches=patches)
        print(f"wrote {a.out}")
        return 0
    # ---------------------------------------------------------------------------
    plot_fit(src, a.out, patches=patches, max_patches=a.max_patches)
    print(f"wrote {a.out}")
    return 0


def _is_forecast(path: Path) -> bool:
    """Whether a netCDF file is a forecast (`epifit_kind = "forecast"`)."""
    import netCDF4

    try:
        with netCDF4.Dataset(path) as nc:
            return getattr(nc, "epifit_kind", None) == "forecast"
    except OSError:
        return False  # plot_fit reports unreadable files


COMMAND = (
    "draw a fit or simulation against its data (PNG/PDF/SVG)",
    _add_arguments,
    _run,
)
