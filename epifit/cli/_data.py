"""`epifit data ...`: data tables to datasets in epifit's conventions.

`epifit data import TABLE.csv --out DATA.nc` wraps `epifit.data.from_csv` and
`epifit.data.write_dataset`. Errors are raised (`DataError`, `FileNotFoundError`,
`ValueError`) and reported once by `epifit.cli.main`.
"""

from __future__ import annotations

import argparse

from epifit._paths import existing_file, output_file, output_lock
from epifit.cli._json import dumps

HELP = "convert data tables to datasets (epifit data import TABLE.csv --out DATA.nc)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    actions = p.add_subparsers(dest="data_action", metavar="ACTION", required=True)
    imp = actions.add_parser(
        "import",
        help="read a CSV table of counts into a netCDF dataset",
        description=(
            "Read a CSV table into a dataset with dims (time[, patch]) and write it "
            "as netCDF. Long layout (one row per date and place): give --patch. "
            "Wide layout (one row per date, one column per series): omit it. "
            "Dates every k days (k = 7: weekly totals) stay on that axis; each "
            "variable records k as its attribute 'period' (1 for daily data)."
        ),
    )
    imp.add_argument("table", help="CSV file")
    imp.add_argument("--out", required=True, help="netCDF file to write")
    imp.add_argument("--time", default="date", help="date column (default: date)")
    imp.add_argument("--patch", help="place column (long layout)")
    imp.add_argument(
        "--values",
        help="comma-separated value columns (default: all other columns)",
    )
    imp.add_argument(
        "--attr",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="dataset attribute, as a string (repeatable; default source=TABLE)",
    )
    imp.add_argument(
        "--no-fill-days",
        dest="fill_days",
        action="store_false",
        help="keep only the dates present in the table (default: every day, or "
        "every k-th day of a k-daily table such as weekly totals, from the first "
        "to the last, NaN where missing)",
    )
    imp.add_argument("--json", action="store_true", help="print a JSON summary")


def run(a: argparse.Namespace) -> int:
    return {"import": _import}[a.data_action](a)


def _import(a: argparse.Namespace) -> int:
    from epifit.data import from_csv, write_dataset

    table = existing_file(a.table, "CSV")
    values = None if a.values is None else _names(a.values)
    attrs = {"source": table.name, **_attrs(a.attr)}
    out = output_file(a.out, inputs={"the table": table})
    with output_lock(out):
        ds = from_csv(
            table,
            time=a.time,
            patch=a.patch,
            values=values,
            attrs=attrs,
            fill_days=a.fill_days,
        )
        out = write_dataset(ds, out)
    summary = _summary(out, ds)
    if a.json:
        print(dumps(summary))
    else:
        where = "" if summary["patches"] is None else f" x {summary['patches']} patches"
        period = summary["period"]
        every = "" if period in (1, None) else f" (every {period} days)"
        print(
            f"wrote {out}: {', '.join(summary['variables'])}, "
            f"{summary['times']} {'days' if period in (1, None) else 'dates'}"
            f"{every}{where}"
        )
    return 0


def _summary(out, ds) -> dict:
    """What was written: the variables, the number of time points (`times`),
    the days they span (`days`, `times * period`: a weekly total covers 7),
    the period in days (`None` for dates of no one step, `--no-fill-days`) and
    the number of patches."""
    periods = {v.attrs.get("period") for v in ds.data_vars.values()}
    period = periods.pop() if len(periods) == 1 else None
    times = int(ds.sizes["time"])
    return {
        "out": str(out),
        "variables": [str(v) for v in ds.data_vars],
        "days": times * (period or 1),
        "times": times,
        "period": period,
        "patches": int(ds.sizes["patch"]) if "patch" in ds.dims else None,
    }


def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",")]
    if not all(names):
        raise ValueError(
            f"--values {text!r} has an empty column name; write names separated by "
            "commas, e.g. --values cases,deaths"
        )
    return names


def _attrs(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(
                f"--attr {item!r} is not KEY=VALUE; write e.g. --attr "
                "title='Cases by region'"
            )
        out[key.strip()] = value
    return out


COMMAND = (HELP, add_arguments, run)
