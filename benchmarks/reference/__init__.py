"""The reference problem of the benchmarks and the peers' configurations of
its loss (see `benchmarks/README.md`): `reference.problem` (NumPy and JAX
only) and `reference.peers` (diffrax, imported when a diffrax peer is built).
Import them with `benchmarks/` on `sys.path`, as the benchmarks and tests do."""
