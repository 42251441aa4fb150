"""Reading a fit file's stored fields (`epifit.fitting._result_io`): the
parameter table, JSON and prefixed attributes, and the one-line error for a
damaged file."""

from __future__ import annotations

import json
from typing import Any

import xarray as xr

from epifit.data import DataError

TABLE_VARS = ("estimate", "se", "lower", "upper")


def damaged(where, why: str) -> DataError:
    return DataError(
        f"{where} is not a complete epifit fit file: {why}; write it again with "
        "`epifit calibrate`."
    )


def json_attr(ds: xr.Dataset, where, name: str) -> Any:
    """A JSON attribute (`{}` when absent)."""
    try:
        return json.loads(ds.attrs.get(name, "{}"))
    except (TypeError, ValueError) as e:
        raise damaged(where, f"attribute '{name}' is not JSON ({e})") from None


def stored_table(ds: xr.Dataset) -> list[dict]:
    return [
        dict(
            label=str(lab),
            name=str(ds["parameter_name"].values[i]),
            patch=str(ds["parameter_patch"].values[i]),
            kind=str(ds["parameter_kind"].values[i]),
            **{k: float(ds[k].values[i]) for k in TABLE_VARS},
        )
        for i, lab in enumerate(ds["parameter"].values)
    ]


def prefixed(attrs: dict, prefix: str, convert) -> dict[str, Any]:
    return {
        k[len(prefix) :]: convert(v) for k, v in attrs.items() if k.startswith(prefix)
    }
