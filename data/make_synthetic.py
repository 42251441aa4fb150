"""Write a synthetic metapopulation dataset simulated from known parameters.

A thin wrapper over `epifit.simulation.synthetic_metapopulation` (see its docstring
for the covariates, the true parameters, the units and the noise). The committed
`synthetic_metapop_20.nc` was made, from the repository root, by

    .venv/bin/python data/make_synthetic.py --patches 20 --days 90 --seed 0 \\
        --noise poisson --out data/synthetic_metapop_20.nc

Larger datasets are generated on demand this way and never committed.
"""

import argparse
import sys
from pathlib import Path

import jax

from epifit.data import write_dataset
from epifit.simulation import synthetic_metapopulation

REPO = Path(__file__).resolve().parents[1]
NOISES = ("poisson", "negative_binomial", "gaussian", "none")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        type=Path,
        default=REPO / "models" / "seird_metapop_mobility.toml",
        help="model file (default: models/seird_metapop_mobility.toml)",
    )
    parser.add_argument("--patches", type=int, default=20, help="number of patches")
    parser.add_argument("--days", type=int, default=90, help="number of days")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument("--noise", choices=NOISES, default="poisson")
    parser.add_argument(
        "--dispersion",
        type=float,
        help="negative binomial phi (default 10) or Gaussian relative sd (0.1)",
    )
    parser.add_argument("--out", type=Path, required=True, help="netCDF to write")
    args = parser.parse_args(argv)
    jax.config.update("jax_enable_x64", True)
    ds, _ = synthetic_metapopulation(
        args.model,
        args.patches,
        args.days,
        seed=args.seed,
        noise=args.noise,
        dispersion=args.dispersion,
    )
    ds.attrs["history"] = (
        f"data/make_synthetic.py --patches {args.patches} --days {args.days} "
        f"--seed {args.seed} --noise {args.noise}"
        + ("" if args.dispersion is None else f" --dispersion {args.dispersion}")
    )
    path = write_dataset(ds, args.out)
    print(
        f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB): "
        f"{args.patches} patches x {args.days} days, {args.noise} noise, "
        f"seed {args.seed}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
