"""The forward step's stage evaluations compile to one set of kernels.

`epifit.ode` evaluates each stage of an explicit Runge-Kutta step behind a
`cond` whose operand is the stage state, so the vector field's fused kernels
are the same for every stage and XLA CPU compiles them once (measurements:
`epifit/ode/README.md`). These tests read the optimised HLO of a solve: the
stage branches are one computation up to names, and the stage combination
is not fused into them.
"""

from __future__ import annotations

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from epifit.ode import Bosh3, PIDController, Tsit5, solve

N = 40


def _vf(t, y, args, u):
    force = args["beta"] * (y["I"].sum(axis=0) + 0.1 * jnp.roll(y["I"][0], 1))
    inf = force * y["S"][0]
    out = args["gamma"] * y["I"]
    d_i = jnp.concatenate([inf[None] - out[:1], out[:-1] - out[1:]])
    return {"S": -inf[None], "I": d_i, "R": out[-1:]}


Y0 = {
    "S": jnp.full((1, N), 0.99),
    "I": jnp.concatenate([jnp.full((1, N), 0.01), jnp.zeros((2, N))]),
    "R": jnp.zeros((1, N)),
}


def _computations(text):
    comps, name = {}, None
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            name = head.group(1)
            comps[name] = []
        elif name is not None and line.strip() and line.strip() != "}":
            comps[name].append(line)
    return comps


def _signature(comps, name):
    """The computation `name` as its instructions' opcodes and shapes, the
    computations it calls expanded in place (names and metadata dropped)."""
    out = []
    for line in comps[name]:
        m = re.match(r"\s*(?:ROOT )?%[\w.\-]+ = (.+?) ([\w\-]+)\(", line)
        if not m:
            continue
        shape, op = m.groups()
        called = re.findall(r"(?:calls|to_apply|body|condition)=%([\w.\-]+)", line)
        out.append((op, shape, tuple(_signature(comps, c) for c in called)))
    return tuple(out)


def _stage_branches(solver):
    def loss(beta):
        sol = solve(
            _vf,
            Y0,
            {"beta": beta, "gamma": 0.3},
            ts=np.linspace(0.0, 20.0, 11),
            solver=solver,
            stepsize_controller=PIDController(rtol=1e-5, atol=1e-8),
        )
        return jnp.sum(sol.ys["I"] ** 2)

    text = jax.jit(loss).lower(0.5).compile().as_text()
    comps = _computations(text)
    branches = re.findall(r"conditional\(.*?branch_computations=\{([^}]*)\}", text)
    sigs = []
    for b in branches:
        names = [x.strip().lstrip("%") for x in b.split(",")]
        sigs.append([_signature(comps, n) for n in names])
    return sigs


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU layout")
@pytest.mark.parametrize(("solver", "stages"), [(Tsit5(), 6), (Bosh3(), 3)])
def test_stage_evaluations_are_one_computation(solver, stages):
    """Every stage after the first is evaluated in a branch that is the same
    computation: `stages` conditionals share one vector-field branch."""
    pairs = collections.Counter(tuple(p) for p in _stage_branches(solver))
    (vf_branch, nan_branch), count = pairs.most_common(1)[0]
    # `stages` conditionals of one (vector field, NaN fill) pair of branches
    assert count >= stages, pairs.most_common(3)
    assert sum(op == "fusion" for op, _, _ in vf_branch) >= 2
    assert not any(op == "conditional" for op, _, _ in vf_branch)
