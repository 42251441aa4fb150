"""The host-side record of an optimiser run (`epifit.fitting._optimize`):
per-start histories of loss, gradient norm and step, all NumPy, saved in
checkpoints."""

from __future__ import annotations

import numpy as np

HISTORY = ("loss", "grad_norm", "step")


def new_record(n_starts: int, initial_loss: np.ndarray) -> dict:
    """The host-side record of a run (all NumPy, saved in checkpoints)."""
    return {
        "phase": 0,
        "phase_iteration": 0,
        "iteration": 0,
        "history": {
            k: [np.zeros((0,)) for _ in range(n_starts)] for k in (*HISTORY, "phase")
        },
        "initial_loss": np.asarray(initial_loss, np.float64),
        "statuses": [],
        "elapsed": 0.0,
    }


def append_history(rec: dict, buf, counts, p: int) -> None:
    """Append each start's iterations of a chunk to its history."""
    hist = rec["history"]
    arrays = [np.asarray(b) for b in buf]
    for s, c in enumerate(counts):
        c = int(c)
        for key, b in zip(HISTORY, arrays, strict=True):
            hist[key][s] = np.concatenate([hist[key][s], b[s, :c]])
        hist["phase"][s] = np.concatenate([hist["phase"][s], np.full((c,), float(p))])
