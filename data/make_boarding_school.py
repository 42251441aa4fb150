"""Write `boarding_school_1978.nc`: influenza in an English boarding school, 1978.

The counts are those published in the British Medical Journal of 4 March 1978
("Influenza in a boarding school", BMJ 1978;1(6112):587,
doi:10.1136/bmj.1.6112.587) for an outbreak of influenza among the 763 boys of
an English boarding school. For 14 consecutive days from
22 January 1978 it gives the number of boys confined to bed and the number
convalescent.

Run from the repository root:

    .venv/bin/python data/make_boarding_school.py [--out data/boarding_school_1978.nc]
"""

import argparse
import sys
from pathlib import Path

import numpy as np
import xarray as xr

from epifit.data import write_dataset

START = "1978-01-22"
POPULATION = 763
IN_BED = [3, 8, 26, 76, 225, 298, 258, 233, 189, 128, 68, 29, 14, 4]
CONVALESCENT = [0, 0, 0, 0, 9, 17, 105, 162, 176, 166, 150, 85, 47, 20]
CITATION = (
    "Anonymous (1978). Influenza in a boarding school. British Medical Journal "
    "1(6112): 587 (4 March 1978). doi:10.1136/bmj.1.6112.587"
)


def make_dataset() -> xr.Dataset:
    """The outbreak as a dataset in epifit's conventions (dims `(time,)`)."""
    if len(IN_BED) != len(CONVALESCENT):
        raise AssertionError("in_bed and convalescent must cover the same days")
    time = np.datetime64(START, "D") + np.arange(len(IN_BED))
    ds = xr.Dataset(
        {
            "in_bed": (
                "time",
                np.asarray(IN_BED, dtype=np.int64),
                {
                    "long_name": "number of boys confined to bed",
                    "units": "1",
                },
            ),
            "convalescent": (
                "time",
                np.asarray(CONVALESCENT, dtype=np.int64),
                {
                    "long_name": "number of boys convalescent (out of bed, not "
                    "yet back in class)",
                    "units": "1",
                },
            ),
            "population": (
                (),
                np.int64(POPULATION),
                {"long_name": "number of boys at the school", "units": "1"},
            ),
        },
        coords={
            "time": (
                "time",
                time.astype("datetime64[ns]"),
                {"long_name": "date of the count", "standard_name": "time"},
            )
        },
        attrs={
            "title": "Influenza in an English boarding school, January-February 1978",
            "source": "British Medical Journal, 4 March 1978, p. 587",
            "references": CITATION,
            "comment": (
                f"{POPULATION} boys; counts on {len(IN_BED)} consecutive days from "
                f"{START}. Written by data/make_boarding_school.py."
            ),
            "Conventions": "CF-1.8",
        },
    )
    return ds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).with_name("boarding_school_1978.nc"),
        help="netCDF file to write (default: next to this script)",
    )
    args = parser.parse_args(argv)
    path = write_dataset(make_dataset(), args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
