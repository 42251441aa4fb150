"""TOML front door: `models/*.toml` -> `ModelSpec` (stdlib `tomllib`)."""

from __future__ import annotations

import os
from pathlib import Path

from epifit._stored import note_input
from epifit.model._errors import ModelSpecError
from epifit.model._fields import ModelReader
from epifit.model._spec import ModelSpec
from epifit.model._validate import spec_from_dict

__all__ = ["load_model", "loads_model"]


def loads_model(
    text: str, *, path: str = "<string>", name: str | None = None
) -> ModelSpec:
    """Parse and validate a model from TOML text.

    Args:
        text: the TOML document.
        path: the file name used in error messages.
        name: the model name when the document has no `name`.

    Raises:
        ModelSpecError: for malformed TOML (with the line) and invalid models.
    """
    if not isinstance(text, str):
        raise TypeError(f"loads_model expects str, got {type(text).__name__}")
    data = ModelReader(path).toml(text)
    return spec_from_dict(data, file=path, default_name=name)


def load_model(path: str | os.PathLike) -> ModelSpec:
    """Load and validate a model file such as `models/sir.toml`.

    Args:
        path: the TOML file; its stem names the model when it has no `name`.

    Returns:
        The frozen, validated [`ModelSpec`][epifit.model.ModelSpec].

    Raises:
        ModelSpecError: naming the file, the table/field path and what is wrong,
            e.g. `models/x.toml: transitions[2].to: unknown compartment 'Q'; known:
            S, E, I, R`; also for a missing file and malformed TOML.

    Examples:
        >>> spec = load_model("models/sir.toml")
        >>> [c.name for c in spec.compartments]
        ['S', 'I', 'R']
    """
    p = Path(path)
    try:
        raw = p.read_bytes()
        note_input(p, raw)
    except FileNotFoundError:
        found = (
            sorted(q.name for q in p.parent.glob("*.toml")) if p.parent.is_dir() else []
        )
        raise ModelSpecError(
            f"no such model file; .toml files in {str(p.parent)!r}: "
            + (", ".join(found) if found else "(none)"),
            file=str(path),
        ) from None
    except OSError as e:
        raise ModelSpecError(f"cannot read: {e.strerror}", file=str(path)) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ModelSpecError(
            f"not UTF-8 text (byte {e.start}): {e.reason}", file=str(path)
        ) from None
    return loads_model(text, path=str(path), name=p.stem)
