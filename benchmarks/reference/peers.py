"""The peers' losses of the reference problem: diffrax and `odeint` as a user
writes them, the configurations epifit is measured against.

Every configuration is a loss `loss(p, u0, t_days, mobility, coupling, data)`
of the posted model ([`problem.vector_field`][], covariates `(patch, ...,
day)` read by `rint(t)`) on the daily grid, with
[`problem.loss_from_solution`][]:

* `diffrax-tsit5`: `diffeqsolve` with Tsit5, PID control and diffrax's
  default `RecursiveCheckpointAdjoint`;
* `diffrax-tsit5-backsolve`: the same with `BacksolveAdjoint`;
* `diffrax-tsit5-pytree-bounded`: the state a tuple of 16 rows,
  `Tsit5(scan_kind="bounded")`;
* `odeint`: `jax.experimental.ode.odeint` (Dopri5, a backsolve adjoint), the
  covariates as its arguments, as reported;
* `odeint-closure`: the same with the covariates closed over as constants;
* `reference`: float64 diffrax Tsit5 at rtol 1e-8, atol 1e-12, its steps
  stopped at the half-day jumps of the inputs (`jump_ts`), at most 200000
  steps: the accurate loss and gradient the others are compared with.

The covariates are ordinary (traced) arguments of the solve except in
`odeint-closure`, where they are the concrete arrays given to [`build`][].
The tolerances default to the issue's (rtol 1e-3, atol 1e-6) and 4096 steps.

`throw=False` makes a failed diffrax solve (too many steps, say) give a NaN
loss instead of an error: what `epifit.fitting.Objective` does, so that an
optimiser's line search backs off from the point. `odeint` has no step limit
and never raises; its failures show as non-finite values already.

`../shared/bench/peers.py`, when present, is an independent runner with the
same configurations; `tests/test_reference_crosscheck.py` checks that the two
give the same losses. diffrax is imported only when a diffrax peer is built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from reference import problem

__all__ = ["PEERS", "Peer", "PeerLoss", "arguments", "build", "failure"]


@dataclasses.dataclass(frozen=True)
class Peer:
    """One configuration: the library, the adjoint and the state's form."""

    library: str  # "diffrax" or "odeint"
    adjoint: str  # "recursive-checkpoint" or "backsolve"
    pytree: bool = False  # the state as a tuple of 16 rows (patch,)
    bounded: bool = False  # Tsit5(scan_kind="bounded")
    closure: bool = False  # the covariates closed over, not arguments
    reference: bool = False  # the tight float64 reference solve
    rtol: float = 1e-3
    atol: float = 1e-6
    max_steps: int = 4096  # diffrax's, for the whole solve

    @property
    def solver(self) -> str:
        return "dopri5" if self.library == "odeint" else "tsit5"


PEERS: dict[str, Peer] = {
    "diffrax-tsit5": Peer("diffrax", "recursive-checkpoint"),
    "diffrax-tsit5-backsolve": Peer("diffrax", "backsolve"),
    "diffrax-tsit5-pytree-bounded": Peer(
        "diffrax", "recursive-checkpoint", pytree=True, bounded=True
    ),
    "odeint": Peer("odeint", "backsolve"),
    "odeint-closure": Peer("odeint", "backsolve", closure=True),
    "reference": Peer(
        "diffrax",
        "recursive-checkpoint",
        reference=True,
        rtol=1e-8,
        atol=1e-12,
        max_steps=200_000,
    ),
}


class PeerLoss(NamedTuple):
    """`loss(p, u0, t_days, mobility, coupling, data)` and, for diffrax, the
    `solve(p, u0, t_days, mobility, coupling)` it differentiates (for its
    `stats` and `result`); `None` for odeint."""

    loss: Callable[..., Any]
    solve: Callable[..., Any] | None


def arguments(P: dict, dtype) -> tuple:
    """The loss's arguments at `p_init` of the problem `P`, as `dtype` arrays."""
    keys = ("p_init", "u0", "t_days", "mobility", "coupling", "data")
    return tuple(jnp.asarray(P[k], dtype) for k in keys)


def build(
    name: str,
    mobility,
    coupling,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    max_steps: int | None = None,
    throw: bool = True,
) -> PeerLoss:
    """The loss of the configuration `name` (see `PEERS`).

    Args:
        name: a key of `PEERS`.
        mobility, coupling: the covariates `(patch, 7, day)`, `(patch, patch,
            day)`: closed over by `odeint-closure`, unused by the others (they
            take them as arguments).
        rtol, atol, max_steps: override the configuration's.
        throw: `False`: a failed diffrax solve gives a NaN loss (see above).

    Raises:
        ValueError: an unknown name, listing the known ones.
    """
    if name not in PEERS:
        raise ValueError(f"unknown peer {name!r}; known: {', '.join(PEERS)}")
    peer = PEERS[name]
    peer = dataclasses.replace(
        peer,
        rtol=peer.rtol if rtol is None else rtol,
        atol=peer.atol if atol is None else atol,
        max_steps=peer.max_steps if max_steps is None else max_steps,
    )
    if peer.library == "odeint":
        return PeerLoss(_odeint_loss(peer, mobility, coupling), None)
    return _diffrax_loss(peer, mobility, coupling, throw)


def _odeint_loss(peer: Peer, mobility_c, coupling_c):
    from jax.experimental.ode import odeint

    f = problem.vector_field
    tol = {"rtol": peer.rtol, "atol": peer.atol}

    if peer.closure:
        # concrete constants: closure_convert does not hoist them, so the
        # backsolve adjoint integrates no cotangent for them
        def loss(p, u0, t_days, mobility, coupling, data):
            del mobility, coupling

            def vf(u, t, p):
                return f(u, t, p, mobility_c, coupling_c)

            return problem.loss_from_solution(odeint(vf, u0, t_days, p, **tol), data)

        return loss

    def loss(p, u0, t_days, mobility, coupling, data):
        sol = odeint(f, u0, t_days, p, mobility, coupling, **tol)
        return problem.loss_from_solution(sol, data)

    return loss


def _diffrax_loss(peer: Peer, mobility_c, coupling_c, throw: bool) -> PeerLoss:
    import diffrax

    f = problem.vector_field_tuple if peer.pytree else problem.vector_field
    kw = {"scan_kind": "bounded"} if peer.bounded else {}
    solver = diffrax.Tsit5(**kw)
    if peer.adjoint == "backsolve":
        adjoint = diffrax.BacksolveAdjoint()
    else:
        adjoint = diffrax.RecursiveCheckpointAdjoint()

    def solve(p, u0, t_days, mobility, coupling):
        y0 = tuple(u0[k] for k in range(16)) if peer.pytree else u0
        if peer.closure:
            term = diffrax.ODETerm(lambda t, y, p: f(y, t, p, mobility_c, coupling_c))
            args = p
        else:
            term = diffrax.ODETerm(lambda t, y, args: f(y, t, *args))
            args = (p, mobility, coupling)
        jumps = {}
        if peer.reference:  # stop at the half days, where rint(t) changes
            jumps["jump_ts"] = np.arange(t_days.shape[0] - 1) + 0.5
        controller = diffrax.PIDController(rtol=peer.rtol, atol=peer.atol, **jumps)
        return diffrax.diffeqsolve(
            term,
            solver,
            t0=t_days[0],
            t1=t_days[-1],
            dt0=None,
            y0=y0,
            args=args,
            saveat=diffrax.SaveAt(ts=t_days),
            stepsize_controller=controller,
            adjoint=adjoint,
            max_steps=peer.max_steps,
            throw=throw,
        )

    def loss(p, u0, t_days, mobility, coupling, data):
        sol = solve(p, u0, t_days, mobility, coupling)
        if peer.pytree:
            value = problem.loss_from_s_d(sol.ys[0], sol.ys[9], data)
        else:
            value = problem.loss_from_solution(sol.ys, data)
        if throw:
            return value
        ok = sol.result == diffrax.RESULTS.successful
        return jnp.where(ok, value, jnp.nan)

    return PeerLoss(loss, solve)


def failure(solution) -> str | None:
    """What went wrong in a diffrax solution (concrete), or `None`."""
    import diffrax

    if solution.result == diffrax.RESULTS.successful:
        return None
    return diffrax.RESULTS[solution.result]
