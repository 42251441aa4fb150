"""`epifit calibrate MODEL.toml --data DATA.nc --out FIT.nc`."""

from __future__ import annotations

import argparse
import warnings

import epifit.cli._flags as _flags
from epifit._paths import existing_file, output_file, output_lock
from epifit.cli._json import dumps
from epifit.cli._stored import programs_kept


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model file (TOML)")
    p.add_argument("--data", required=True, help="dataset (netCDF) with observations")
    p.add_argument("--out", required=True, help="output fit file (netCDF), FIT.nc")
    p.add_argument("--fit", help="fit configuration (TOML): phases, overrides, ...")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the checkpoint beside --out (FIT.ckpt) if there is one",
    )
    p.add_argument(
        "--checkpoint-every",
        type=_flags.count,
        metavar="N",
        help="checkpoint the optimiser state every N iterations to FIT.ckpt",
    )
    p.add_argument(
        "--seed", type=_flags.seed, help="seed of the multi-start perturbations"
    )
    p.add_argument(
        "--n-starts",
        type=_flags.starts,
        help="starting points (multi-start)",
    )
    p.add_argument("--max-iterations", type=_flags.count, help="cap on iterations")
    p.add_argument(
        "--time-budget", type=_flags.tolerance, help="seconds; stop (and checkpoint)"
    )
    p.add_argument("--rtol", type=_flags.tolerance, help="solver relative tolerance")
    p.add_argument("--atol", type=_flags.tolerance, help="solver absolute tolerance")
    _adjoint_arg(p)
    p.add_argument(
        "--no-uncertainty", action="store_true", help="skip the Laplace approximation"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print a JSON summary")


def _adjoint_arg(p: argparse.ArgumentParser) -> None:
    """`--adjoint NAME`: the names of `ADJOINTS`; the default is the adjoint of
    `SolverSettings()` (the ODE core's)."""
    from epifit.simulation import ADJOINTS, SolverSettings

    default = SolverSettings().to_dict()["adjoint"]
    name = next(k for k, cls in ADJOINTS.items() if cls.__name__ == default)
    p.add_argument(
        "--adjoint",
        choices=tuple(ADJOINTS),
        help=f"how gradients are computed (default {name})",
    )


def _run(a) -> int:
    from epifit.data import write_dataset
    from epifit.fitting import checkpoint_path

    model = existing_file(a.model, "Model")
    data = existing_file(a.data, "Data")
    fit = existing_file(a.fit, "Fit configuration") if a.fit else None
    inputs = {"the model": model, "--data": data, "--fit": fit}
    # the checkpoint is written (and read on --resume) beside --out
    ckpt = {"its checkpoint": checkpoint_path(a.out)}
    out = output_file(a.out, inputs=inputs, also_writes=ckpt)
    with output_lock(out):
        result = _calibrate(a, model, data, fit, out)
        ds = result.to_dataset()
        ds.attrs["command"] = " ".join(
            ["epifit calibrate", a.model, f"--data {a.data}", f"--out {a.out}"]
            + ([f"--fit {a.fit}"] if a.fit else [])
        )
        write_dataset(ds, out)
    if a.json:
        summary = result.to_json()
        summary["out"] = str(out)
        print(dumps(summary))
    else:
        print(result.summary())
        print(f"wrote {out}")
    return 0


# the flags that are fit settings, checked as the fields of a fit file are
_SETTING_FLAGS = {
    "seed": "--seed",
    "n_starts": "--n-starts",
    "max_iterations": "--max-iterations",
    "time_budget": "--time-budget",
    "rtol": "--rtol",
    "atol": "--atol",
}


def _calibrate(a, model, data, fit, out):
    from epifit.fitting import calibrate, check_fit_settings, checkpoint_path

    check_fit_settings(
        {key: getattr(a, key) for key in _SETTING_FLAGS},
        file="epifit calibrate",
        names=_SETTING_FLAGS,
    )
    use_checkpoint = a.resume or a.checkpoint_every is not None
    with programs_kept(a), warnings.catch_warnings():
        # a fit stopped by persistent non-finite losses says so in its summary
        warnings.filterwarnings("ignore", message="stopped: ", category=RuntimeWarning)
        result = calibrate(
            model,
            data,
            fit=fit,
            seed=a.seed,
            n_starts=a.n_starts,
            max_iterations=a.max_iterations,
            time_budget=a.time_budget,
            rtol=a.rtol,
            atol=a.atol,
            adjoint=a.adjoint,
            uncertainty=False if a.no_uncertainty else None,
            checkpoint=checkpoint_path(out) if use_checkpoint else None,
            checkpoint_every=a.checkpoint_every,
            resume=a.resume,
            progress=False if a.no_progress else "auto",
        )
    return result


COMMAND = (
    "fit a model's free parameters to data; write FIT.nc with intervals",
    _add_arguments,
    _run,
)
