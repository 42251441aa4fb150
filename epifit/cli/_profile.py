"""`epifit profile FIT.nc --parameter gamma [--points 21] [--out PROFILE.nc]`."""

from __future__ import annotations

import argparse
import shlex

import epifit.cli._flags as _flags
from epifit._paths import existing_file, output_file, output_lock
from epifit.cli._json import dumps
from epifit.cli._plot import fit_inputs

# the library's argument names -> this command's flags, in its errors
_FLAGS = {"parameter": "--parameter", "points": "--points", "span": "--span"}


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("fit", help="a fit file (epifit calibrate), FIT.nc")
    p.add_argument(
        "--parameter",
        required=True,
        help="the free parameter to profile: a scalar's name (gamma) or a label "
        "of the free vector (scaler[north])",
    )
    p.add_argument(
        "--points",
        type=_flags.count,
        help="grid points, 3 to 1001, the fitted value among them (default 21)",
    )
    p.add_argument(
        "--span",
        type=_flags.number(positive=True),
        help="the grid's half-width in Laplace standard errors on the transformed "
        "scale (default 4)",
    )
    p.add_argument(
        "--out",
        help="output profile file (netCDF); default FIT.profile-PARAMETER.nc "
        "beside FIT.nc",
    )
    p.add_argument("--plot", help="also draw the profile to this figure (.png, ...)")
    p.add_argument(
        "--data", help="the fit's dataset, when the data file named in FIT.nc moved"
    )
    p.add_argument("--json", action="store_true", help="print a JSON summary")


def _run(a) -> int:
    from epifit.data import write_dataset
    from epifit.fitting import ProfileError, plot_profile, profile, profile_output

    fit = existing_file(a.fit, "Fit")
    data = existing_file(a.data, "Data") if a.data else None
    inputs = {"--data": data, **fit_inputs(fit)}
    out = output_file(a.out or profile_output(fit, a.parameter), inputs=inputs)
    plot = None
    if a.plot:
        plot = output_file(
            a.plot, flag="--plot", inputs=inputs, also_writes={"--out": out}
        )
    with output_lock(out):
        try:
            given = {"points": a.points, "span": a.span}
            kw = {k: v for k, v in given.items() if v is not None}
            result = profile(fit, a.parameter, data=data, **kw)
        except ProfileError as e:
            raise ProfileError(
                e.reason, file=e.file, location=_FLAGS.get(e.location, e.location)
            ) from None
        ds = result.to_dataset()
        ds.attrs["command"] = _command(a)
        write_dataset(ds, out)
    if plot is not None:
        plot_profile(out, plot)
    if a.json:
        summary = result.to_json()
        summary["out"] = str(out)
        if plot is not None:
            summary["plot"] = str(plot)
        print(dumps(summary))
        return 0
    print(result.summary())
    print(f"wrote {out}" + (f" and {plot}" if plot is not None else ""))
    return 0


def _command(a) -> str:
    words = ["epifit", "profile", a.fit, "--parameter", a.parameter]
    for flag, value in (
        ("--points", a.points),
        ("--span", a.span),
        ("--out", a.out),
        ("--data", a.data),
        ("--plot", a.plot),
    ):
        if value is not None:
            words += [flag, str(value)]
    return shlex.join(words)


COMMAND = (
    "profile likelihood of one parameter of a fit; write PROFILE.nc with the "
    "likelihood-ratio interval",
    _add_arguments,
    _run,
)
