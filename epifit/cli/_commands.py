"""Sub-command handlers: each parses nothing itself and calls the library."""

from __future__ import annotations

import argparse
import json
import shlex

import epifit.cli._flags as _flags
from epifit._paths import existing_file, output_file, output_lock
from epifit.cli._json import dumps
from epifit.cli._stored import programs_kept


def _tolerance_args(p: argparse.ArgumentParser) -> None:
    """`--rtol` and `--atol`, defaulting to `SolverSettings`'s tolerances."""
    from epifit.simulation import SolverSettings

    default = SolverSettings()
    for flag, value, what in (
        ("--rtol", default.rtol, "relative"),
        ("--atol", default.atol, "absolute"),
    ):
        p.add_argument(
            flag,
            type=_flags.tolerance,
            default=value,
            help=f"solver {what} tolerance (default {value:g})",
        )


# ----------------------------------------------------------------- simulate
def _simulate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model file (TOML)")
    p.add_argument("--data", help="dataset (netCDF) with covariates/initial data")
    p.add_argument("--out", required=True, help="output netCDF file")
    p.add_argument("--params", help="parameter values (TOML or JSON: name = value)")
    p.add_argument(
        "--days", type=_flags.count, help="days to simulate (default: the data's)"
    )
    p.add_argument(
        "--patches", type=_flags.count, help="patches, for a model run without data"
    )
    _tolerance_args(p)
    _observe_args(p)
    p.add_argument("--json", action="store_true", help="print a JSON summary")


def _observe_args(p: argparse.ArgumentParser) -> None:
    """`--observe [FAMILY]`, `--seed`, `--start`: synthetic observations."""
    from epifit.simulation import OBSERVE

    p.add_argument(
        "--observe",
        nargs="?",
        const="model",
        choices=OBSERVE,
        metavar="FAMILY",
        help="add noisy observations under their own names, drawn from each "
        "observation's family (no value, or 'model') or from poisson, "
        "negative_binomial or gaussian; the output is then data for calibrate",
    )
    p.add_argument(
        "--seed",
        type=_flags.seed,
        help="seed of the observation noise (default 0; only with --observe)",
    )
    p.add_argument(
        "--start",
        type=_flags.date,
        help="first date YYYY-MM-DD of a run without dated data (default "
        "2020-01-01 with --observe; else the time axis is in days)",
    )


def _simulate(a) -> int:
    from epifit.data import write_dataset
    from epifit.simulation import simulate

    if a.seed is not None and a.observe is None:
        raise ValueError("--seed seeds the observation noise; give it with --observe")
    model = existing_file(a.model, "Model")
    data = existing_file(a.data, "Data") if a.data else None
    params = existing_file(a.params, "Parameter") if a.params else None
    # before the solve, not after it
    inputs = {"the model": model, "--data": data, "--params": params}
    out = output_file(a.out, inputs=inputs)
    with output_lock(out), programs_kept(a):
        ds = simulate(
            model,
            data,
            values=params,
            days=a.days,
            n_patches=a.patches,
            rtol=a.rtol,
            atol=a.atol,
            observe=a.observe,
            seed=0 if a.seed is None else a.seed,
            start=a.start,
        )
        ds.attrs["command"] = _simulate_command(a)
        out = write_dataset(ds, out)
    summary = {
        "out": str(out),
        "model": ds.attrs["model"],
        "days": int(ds.sizes["time"]),
        "patches": int(ds.sizes["patch"]),
        "steps": ds.attrs.get("solver_num_accepted_steps"),
    }
    if a.observe is not None:
        summary["observed"] = json.loads(ds.attrs["observation_noise"])
        summary["seed"] = ds.attrs["observation_seed"]
    if a.json:
        print(dumps(summary))
        return 0
    text = (
        f"wrote {out}: model '{summary['model']}', {summary['days']} days x "
        f"{summary['patches']} patches, {summary['steps']} solver steps"
    )
    if a.observe is not None:
        drawn = ", ".join(f"{k} ({v})" for k, v in summary["observed"].items())
        text += f"; simulated observations {drawn}, seed {summary['seed']}"
    print(text)
    return 0


def _simulate_command(a) -> str:
    """The command line that reproduces `a`, paths as the user gave them and the
    tolerances and precision used written out."""
    words = ["epifit", "--dtype", a.dtype, "simulate", a.model]
    for flag, value in [
        ("--data", a.data),
        ("--out", a.out),
        ("--params", a.params),
        ("--days", a.days),
        ("--patches", a.patches),
        ("--rtol", a.rtol),
        ("--atol", a.atol),
        ("--observe", a.observe),
        ("--seed", a.seed),
        ("--start", a.start),
    ]:
        if value is not None:
            words += [flag, str(value)]
    if a.json:
        words.append("--json")
    return shlex.join(words)


# ----------------------------------------------------------------- adjoints
def _adjoints_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model file (TOML)")
    p.add_argument("--data", required=True, help="dataset (netCDF) with observations")
    p.add_argument("--params", help="parameter values (TOML or JSON: name = value)")
    _tolerance_args(p)
    p.add_argument("--repeats", type=_flags.count, default=3)
    p.add_argument("--json", action="store_true", help="print the records as JSON")


def _adjoints(a) -> int:
    from epifit.fitting import audit_adjoints
    from epifit.simulation import Problem, load_params

    problem = Problem(existing_file(a.model, "Model"), existing_file(a.data, "Data"))
    params = load_params(
        problem, existing_file(a.params, "Parameter") if a.params else None
    )
    audit = audit_adjoints(problem, params, rtol=a.rtol, atol=a.atol, repeats=a.repeats)
    if a.json:
        print(
            dumps(
                {
                    "records": audit.records,
                    "recommended": audit.recommended,
                    "reason": audit.reason,
                    "reference": audit.reference,
                }
            )
        )
    else:
        print(audit.table())
    return 0


def _registered() -> dict:
    """Sub-commands of other modules: each `epifit/cli/_<name>.py` listed here
    defines `COMMAND = (help, add_arguments, run)`."""
    import importlib

    out = {}
    for name in ("calibrate", "plot", "data", "forecast", "profile", "sample", "batch"):
        try:
            mod = importlib.import_module(f"epifit.cli._{name}")
        except ModuleNotFoundError as e:
            if e.name != f"epifit.cli._{name}":
                raise
            continue
        out[name] = mod.COMMAND
    return out


COMMANDS = {
    "adjoints": (
        "compare every adjoint's gradient on a model and data; recommend one",
        _adjoints_args,
        _adjoints,
    ),
    "simulate": (
        "run a model with its initial (or given) parameters; write trajectories",
        _simulate_args,
        _simulate,
    ),
}
COMMANDS.update(_registered())
