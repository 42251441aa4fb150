"""The progress bar of a fit: one `rich` task per phase, updated between chunks."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from epifit.fitting._config import PhaseConfig

__all__ = ["ProgressBar", "progress_enabled"]


def progress_enabled(progress: bool | str) -> bool:
    """`True`/`False`, or `"auto"`: on when stderr is a terminal or a notebook."""
    if isinstance(progress, bool):
        return progress
    if progress != "auto":
        raise ValueError(f"progress must be True, False or 'auto'; got {progress!r}.")
    from rich.console import Console

    console = Console(stderr=True)
    return bool(console.is_terminal or console.is_jupyter)


class ProgressBar:
    """Shows phase, iterations, loss, gradient norm, step and ETA on stderr.

    Use as a context manager; `phase` starts a phase's bar, `update` refreshes
    it with the best start's numbers after every chunk.
    """

    def __init__(self, phases: Sequence[PhaseConfig], *, n_starts: int = 1):
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.phases = tuple(phases)
        self.n_starts = n_starts
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}  |g| {task.fields[grad]}"),
            TextColumn("step {task.fields[step]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            transient=False,
        )
        self._task = None

    def __enter__(self):
        self._progress.__enter__()
        return self

    def __exit__(self, *exc):
        self._progress.__exit__(*exc)

    def phase(self, p: int, phase: PhaseConfig, record: dict) -> None:
        if self._task is not None:
            self._progress.update(self._task, refresh=True)
            self._progress.stop_task(self._task)
        starts = f" x{self.n_starts} starts" if self.n_starts > 1 else ""
        self._task = self._progress.add_task(
            f"{p + 1}/{len(self.phases)} {phase.method}{starts}",
            total=phase.iterations,
            completed=record["phase_iteration"],
            loss="-",
            grad="-",
            step="-",
        )

    def update(self, carry, record: dict) -> None:
        f = np.asarray(carry.f)
        best = int(np.nanargmin(np.where(np.isfinite(f), f, np.inf)))
        hist = record["history"]
        step = hist["step"][best][-1] if hist["step"][best].size else np.nan
        self._progress.update(
            self._task,
            completed=record["phase_iteration"],
            loss=f"{f[best]:.6g}",
            grad=f"{float(np.max(np.abs(np.asarray(carry.g)[best]))):.2e}",
            step=f"{step:.2e}",
        )
