"""`epifit sample MODEL --data DATA [--fit FIT.toml] [--init FIT.nc] --out
POSTERIOR.nc`: NUTS posterior draws written as ArviZ netCDF."""

from __future__ import annotations

import argparse
import shlex

import epifit.cli._flags as _flags
from epifit._paths import existing_file, output_file, output_lock
from epifit.cli._json import dumps


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="model file (TOML); not with --init")
    p.add_argument("--data", help="dataset (netCDF) with observations")
    p.add_argument("--fit", help="fit configuration (TOML): priors, solver settings")
    p.add_argument(
        "--init",
        help="a fit (FIT.nc from epifit calibrate) to start from: its MAP and "
        "Laplace covariance (default: calibrate first)",
    )
    p.add_argument("--out", required=True, help="output posterior file (netCDF)")
    p.add_argument("--chains", type=_flags.count, default=4, help="default 4")
    p.add_argument(
        "--warmup", type=_flags.count, default=500, help="adaptation steps (500)"
    )
    p.add_argument("--draws", type=_flags.count, default=1000, help="per chain (1000)")
    p.add_argument("--seed", type=_flags.seed, default=0, help="default 0")
    p.add_argument(
        "--mass-matrix",
        choices=("diagonal", "dense"),
        default="diagonal",
        help="the adapted mass matrix (default diagonal)",
    )
    p.add_argument(
        "--no-whiten",
        action="store_true",
        help="sample the unconstrained parameters themselves, not the Laplace "
        "approximation's whitened coordinates (the default where the start has "
        "a positive definite covariance)",
    )
    p.add_argument(
        "--target-accept",
        type=_flags.number(positive=True),
        default=0.8,
        help="the warm-up's target acceptance rate, in (0, 1) (default 0.8)",
    )
    p.add_argument(
        "--chain-method",
        choices=("sequential", "threads", "vectorized", "processes"),
        help="how the chains run: one after another, in threads of this process, "
        "vmapped in one program, or in worker processes (default: vectorized on a "
        "GPU or TPU, else threads on more than one core, else sequential)",
    )
    p.add_argument(
        "--workers",
        type=_flags.count,
        help="chains at once for --chain-method threads or processes (default: one "
        "per core)",
    )
    p.add_argument(
        "--checkpoint", help="save the chains here after every chunk of draws"
    )
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--json", action="store_true", help="print a JSON summary")


def _run(a) -> int:
    from epifit.sampling import sample

    if a.init and a.model:
        raise ValueError("give either the model (and --data) or --init, not both")
    if not a.init and not (a.model and a.data):
        raise ValueError("sample needs a model and --data, or --init FIT.nc")
    if a.resume and not a.checkpoint:
        raise ValueError("--resume needs --checkpoint FILE")
    if a.workers is not None and a.chain_method in ("sequential", "vectorized"):
        raise ValueError("--workers needs --chain-method threads or processes")
    if not 0.0 < a.target_accept < 1.0:
        raise ValueError(f"--target-accept must lie in (0, 1); got {a.target_accept}")
    model = existing_file(a.model, "Model") if a.model else None
    data = existing_file(a.data, "Data") if a.data else None
    fit = existing_file(a.fit, "Fit configuration") if a.fit else None
    init = existing_file(a.init, "Fit") if a.init else None
    inputs = {"the model": model, "--data": data, "--fit": fit, "--init": init}
    out = output_file(a.out, inputs=inputs)
    with output_lock(out):
        posterior = sample(
            model,
            data,
            fit=fit,
            init=init,
            chains=a.chains,
            warmup=a.warmup,
            draws=a.draws,
            seed=a.seed,
            mass_matrix=a.mass_matrix,
            whiten=False if a.no_whiten else None,
            target_accept=a.target_accept,
            chain_method=a.chain_method,
            workers=a.workers,
            checkpoint=a.checkpoint,
            resume=a.resume,
            progress=False if a.no_progress or a.json else "auto",
        )
        posterior.data.posterior.attrs["command"] = _command(a)
        posterior.to_netcdf(out)
    warnings = posterior.warnings()
    if a.json:
        table = posterior.diagnostics()
        print(
            dumps(
                {
                    "out": str(out),
                    "chains": a.chains,
                    "draws": a.draws,
                    "summary": table.reset_index(names="parameter").to_dict(
                        orient="records"
                    ),
                    "warnings": warnings,
                }
            )
        )
        return 0
    print(posterior.summary())
    print(f"wrote {out}")
    return 0


def _command(a) -> str:
    words = ["epifit", "sample"] + ([a.model] if a.model else [])
    for flag, value in (
        ("--data", a.data),
        ("--fit", a.fit),
        ("--init", a.init),
        ("--out", a.out),
        ("--chains", a.chains),
        ("--warmup", a.warmup),
        ("--draws", a.draws),
        ("--seed", a.seed),
        ("--mass-matrix", a.mass_matrix),
        ("--target-accept", a.target_accept),
        ("--chain-method", a.chain_method),
        ("--workers", a.workers),
        ("--checkpoint", a.checkpoint),
    ):
        if value is not None:
            words += [flag, str(value)]
    words += ["--resume"] * a.resume + ["--no-whiten"] * a.no_whiten
    return shlex.join(words)


COMMAND = (
    "posterior draws by NUTS from a fit's MAP; write POSTERIOR.nc (ArviZ)",
    _add_arguments,
    _run,
)
