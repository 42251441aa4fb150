"""Checkpoints of NUTS chains: each chain's state after its warm-up and after
every chunk of draws, saved atomically; a resumed run continues every chain
where it stopped, to the same numbers."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from epifit.fitting import fingerprint
from epifit.sampling._nuts import STATS, NutsSettings

__all__ = ["SamplerCheckpointError", "chain_checkpoint", "flatten", "unflatten"]

FORMAT = 1


class SamplerCheckpointError(ValueError):
    """A sampler checkpoint that is unreadable or belongs to another run."""


class _Store:
    def __init__(self, path: Path | None, key: str, chains: dict):
        self.path, self.key, self.chains = path, key, chains

    def load(self, chain: int) -> dict | None:
        """The saved state of `chain` (None: start it afresh)."""
        flat = self.chains.get(chain)
        return None if flat is None else unflatten(chain, flat)

    def saved(self, chain: int) -> dict[str, np.ndarray] | None:
        """The saved arrays of `chain`, as a checkpoint holds them."""
        return self.chains.get(chain)

    @property
    def enabled(self) -> bool:
        """Whether the chains are saved at all."""
        return self.path is not None

    def save(self, *snaps: dict) -> None:
        """Save the chains' snapshots (one write for all of them)."""
        if self.path is None:
            return
        for snap in snaps:
            self.chains[snap["chain"]] = flatten(snap)
        self._write()

    def save_flat(self, chain: int, flat: dict[str, np.ndarray]) -> None:
        """Save a snapshot `flatten` made (in a worker process)."""
        if self.path is None:
            return
        self.chains[chain] = flat
        self._write()

    def _write(self) -> None:
        arrays = {"format": np.asarray(FORMAT), "key": np.asarray(self.key)}
        for c, flat in self.chains.items():
            arrays |= {f"chain{c}.{k}": v for k, v in flat.items()}
        tmp = self.path.with_name(self.path.name + f".tmp{os.getpid()}")
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


def flatten(snap: dict) -> dict[str, np.ndarray]:
    """A chain's snapshot as the NumPy arrays a checkpoint holds."""
    state = snap["state"]
    n = np.asarray(state.position).size
    stats = snap["stats"]
    return {
        "done": np.asarray(snap["done"]),
        "position": np.asarray(state.position),
        "logdensity": np.asarray(state.logdensity),
        "logdensity_grad": np.asarray(state.logdensity_grad),
        "step_size": np.asarray(snap["step_size"]),
        "inverse_mass_matrix": np.asarray(snap["inverse_mass_matrix"]),
        "positions": np.concatenate(snap["positions"])
        if snap["positions"]
        else np.zeros((0, n)),
        **{
            f"stat.{name}": np.concatenate([c[i] for c in stats])
            if stats
            else np.zeros((0,))
            for i, name in enumerate(STATS)
        },
    }


def unflatten(chain: int, flat: dict) -> dict:
    """The snapshot `flatten` made, back (for `run_chain`'s `resume`)."""
    from blackjax.mcmc.hmc import HMCState

    done = int(flat["done"])
    return {
        "chain": chain,
        "done": done,
        "state": HMCState(
            jnp.asarray(flat["position"]),
            jnp.asarray(flat["logdensity"]),
            jnp.asarray(flat["logdensity_grad"]),
        ),
        "step_size": jnp.asarray(flat["step_size"]),
        "inverse_mass_matrix": jnp.asarray(flat["inverse_mass_matrix"]),
        "positions": [flat["positions"]] if done else [],
        "stats": [[flat[f"stat.{name}"] for name in STATS]] if done else [],
    }


def chain_checkpoint(
    path, resume: bool, objective, settings: NutsSettings, starts
) -> _Store:
    """The chains' store: nothing saved without `path`; with `resume`, the
    states saved at `path` (checked to belong to this run).

    Raises:
        ValueError: `resume` without a checkpoint file.
        SamplerCheckpointError: a missing, unreadable or foreign checkpoint.
    """
    if path is None:
        if resume:
            raise ValueError("resume=True needs a checkpoint file (checkpoint=...)")
        return _Store(None, "", {})
    path = Path(path)
    key = fingerprint(
        spec=objective.problem.spec,
        arrays=objective.data(),
        xs=np.asarray(starts),
        settings=dataclasses.asdict(settings),
    )
    if not resume:
        return _Store(path, key, {})
    if not path.is_file():
        raise SamplerCheckpointError(f"{path}: no sampler checkpoint to resume from")
    try:
        with np.load(path, allow_pickle=False) as z:
            blob = {k: z[k] for k in z.files}
    except Exception as err:  # noqa: BLE001 - any damage: one located message
        raise SamplerCheckpointError(
            f"{path}: not a readable sampler checkpoint ({err})"
        ) from None
    if "format" not in blob or int(blob["format"]) != FORMAT:
        raise SamplerCheckpointError(f"{path}: not a sampler checkpoint of format 1")
    if str(blob.get("key")) != key:
        raise SamplerCheckpointError(
            f"{path}: the checkpoint belongs to another run (model, data, sampler "
            "settings or starts differ); remove it or run without --resume"
        )
    chains: dict[int, dict] = {}
    for k, v in blob.items():
        if k.startswith("chain"):
            head, field = k.split(".", 1)
            chains.setdefault(int(head[5:]), {})[field] = v
    return _Store(path, key, chains)
