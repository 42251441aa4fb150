"""Compiled models against closed forms and hand-written right-hand sides."""

import equinox as eqx
import jax
import jax.flatten_util
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
import scipy.linalg
from helpers import MODELS, builder_from_dict, to_toml, tree_allclose

from epifit.model import ModelBuilder, ModelSpec, compile_model, load_model, loads_model
from epifit.model._neural import ACTIVATIONS
from epifit.ode import PiecewiseConstant

SHIPPED = ["sir", "seir", "seird_boxcar", "seird_metapop_mobility"]


def _jacobian(model, args, u, y):
    """The Jacobian of a (linear) vector field, on the flattened state."""
    flat, unravel = jax.flatten_util.ravel_pytree(y)

    def f(x):
        return jax.flatten_util.ravel_pytree(
            model.vector_field(0.0, unravel(x), args, u)
        )[0]

    return np.asarray(jax.jit(jax.jacfwd(f))(flat)), unravel


def test_sir_matches_hand_written_rhs():
    model = compile_model(load_model(MODELS / "sir.toml"))
    params = model.init_params(1)
    v = model.constrain(params)
    args, inputs = model.precompute(params, {})
    assert inputs is None
    s, i, r = 700.0, 50.0, 13.0
    y = {"S": jnp.full((1, 1), s), "I": jnp.full((1, 1), i), "R": jnp.full((1, 1), r)}
    dy = model.vector_field(0.0, y, args, None)
    beta, gamma, n = 2.0, 0.5, 763.0
    np.testing.assert_allclose(float(v["beta"]), beta, rtol=1e-14)
    np.testing.assert_allclose(dy["S"][0, 0], -beta * s * i / n, rtol=1e-14)
    np.testing.assert_allclose(dy["I"][0, 0], beta * s * i / n - gamma * i, rtol=1e-14)
    np.testing.assert_allclose(dy["R"][0, 0], gamma * i, rtol=1e-14)
    np.testing.assert_allclose(v["R0"], beta / gamma, rtol=1e-14)


def test_sir_initial_state_and_observation():
    model = compile_model(load_model(MODELS / "sir.toml"))
    params = model.init_params(1)
    y0 = model.initial_state(params, None, 1)
    np.testing.assert_allclose(y0["S"], [[762.0]], rtol=1e-14)
    np.testing.assert_allclose(y0["I"], [[1.0]], rtol=1e-14)
    np.testing.assert_array_equal(y0["R"], [[0.0]])
    ys = {k: jnp.stack([v, 2 * v]) for k, v in y0.items()}  # (time, stage, patch)
    obs = model.observe(ys)
    np.testing.assert_allclose(obs["in_bed"], [[1.0], [2.0]], rtol=1e-14)


@pytest.mark.parametrize(("rate_per", "mean"), [("chain", 1 / 0.4), ("stage", 6 / 0.4)])
def test_box_car_mean_residence_time(rate_per, mean):
    """Erlang chain: mean time to leave = 1/rate ("chain") or stages/rate ("stage")."""
    spec = (
        ModelBuilder("chain")
        .compartment("A", stages=6)
        .compartment("B")
        .parameter("r", 0.4)
        .transition("A", "B", rate="r", rate_per=rate_per)
        .build()
    )
    model = compile_model(spec)
    args, u = model.precompute(model.init_params(1), {})
    y = {"A": jnp.zeros((6, 1)), "B": jnp.zeros((1, 1))}
    jac, _ = _jacobian(model, args, u, y)
    transient = jac[:6, :6]  # A's stages come first in the flattened dict
    e0 = np.eye(6)[0]
    np.testing.assert_allclose(-np.linalg.solve(transient, e0).sum(), mean, rtol=1e-12)


@pytest.mark.parametrize("form", ["probability", "rates"])
def test_branching_ends_in_the_right_proportions(form):
    """Absorption probabilities, from expm of the linear system at a long time."""
    data = {
        "name": "split",
        "compartments": [
            "E",
            {"name": "ID", "stages": 3},
            "D",
            {"name": "IR", "stages": 2},
            "R",
        ],
        "parameters": {
            "sigma": {"value": 0.5},
            "ifr": {"value": 0.2, "transform": "sigmoid"},
            "k": {"value": 0.3},
            "g": {"value": 0.7},
        },
        "transitions": [
            {"from": "ID", "to": "D", "rate": "k", "rate_per": "stage"},
            {"from": "IR", "to": "R", "rate": "g", "rate_per": "chain"},
        ],
    }
    if form == "probability":
        split = {
            "from": "E",
            "rate": "sigma",
            "branches": [{"to": "ID", "probability": "ifr"}, {"to": "IR"}],
        }
        expected = 0.2
    else:
        split = {
            "from": "E",
            "branches": [
                {"to": "ID", "rate": "sigma * ifr"},
                {"to": "IR", "rate": "g"},
            ],
        }
        expected = 0.1 / (0.1 + 0.7)
    data["transitions"].append(split)
    model = compile_model(loads_model(to_toml(data)))
    args, u = model.precompute(model.init_params(1), {})
    y = {c: jnp.zeros((n, 1)) for c, (n, _) in model.state_shapes(1).items()}
    y["E"] = jnp.ones((1, 1))
    jac, unravel = _jacobian(model, args, u, y)
    y0 = jax.flatten_util.ravel_pytree(y)[0]
    final = unravel(scipy.linalg.expm(jac * 500.0) @ np.asarray(y0))
    np.testing.assert_allclose(final["D"][0, 0], expected, rtol=1e-10)
    np.testing.assert_allclose(final["R"][0, 0], 1 - expected, rtol=1e-10)


def _coupled_model(symmetrize, multiplier, local, static, normalize):
    b = (
        ModelBuilder("coupled")
        .compartment("S")
        .compartment("I", stages=2)
        .compartment("R")
        .parameter("beta", [0.3, 0.4, 0.5], per_patch=True)
        .parameter("scale", [1.0, 2.0, 3.0], per_patch=True, transform="softplus")
        .covariate(
            "C",
            ["patch", "patch_to"] if static else ["time", "patch", "patch_to"],
            rule=None if static else "floor",
        )
        .coupling(
            "travel",
            "C",
            scale="scale",
            symmetrize=symmetrize,
            multiplier=multiplier,
            local=local,
        )
        .transition("I", "R", rate=0.2, rate_per="stage")
    )
    if normalize:
        b.covariate("N", ["patch"])
    b.infection(
        "S",
        "I",
        transmission="beta",
        infectious=[{"compartment": "I", "stages": [2], "weight": 0.5}],
        coupling="travel",
        normalize="population" if normalize else None,
        population="N" if normalize else None,
    )
    return compile_model(b.build())


@pytest.mark.parametrize("symmetrize", [False, True])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize(
    ("multiplier", "local", "normalize"),
    [(1.0, 1.0, False), (2.0, 0.0, True), (0.5, 0.3, True)],
)
def test_coupling_matches_numpy(symmetrize, static, multiplier, local, normalize):
    model = _coupled_model(symmetrize, multiplier, local, static, normalize)
    rng = np.random.default_rng(0)
    cube = rng.uniform(0, 1, (4, 3, 3))
    pop = np.array([100.0, 200.0, 50.0])
    covs = {"C": cube[2] if static else cube}
    if normalize:
        covs["N"] = pop
    args, inputs = model.precompute(model.init_params(3), covs)
    assert (inputs is None) == static
    u = None if static else jtu.tree_map(lambda v: v[2], inputs.values)
    y = {
        "S": rng.uniform(0, 1, (1, 3)),
        "I": rng.uniform(0, 1, (2, 3)),
        "R": rng.uniform(0, 1, (1, 3)),
    }
    dy = model.vector_field(2.3, {k: jnp.asarray(v) for k, v in y.items()}, args, u)
    i = 0.5 * y["I"][1]
    if normalize:
        i = i / pop
    c = cube[2] + cube[2].T if symmetrize else cube[2]
    force = np.array([0.3, 0.4, 0.5]) * (
        local * i + multiplier * np.array([1.0, 2.0, 3.0]) * (c @ i)
    )
    np.testing.assert_allclose(dy["S"][0], -force * y["S"][0], rtol=1e-13)
    np.testing.assert_allclose(
        dy["I"][0], force * y["S"][0] - 0.2 * y["I"][0], rtol=1e-13
    )
    np.testing.assert_allclose(dy["R"][0], 0.2 * y["I"][1], rtol=1e-13)


@pytest.mark.parametrize(("rule", "offset"), [("floor", 0.0), ("nearest", -0.5)])
def test_day_grid_follows_the_rule(rule, offset):
    model = compile_model(
        ModelBuilder("g")
        .compartment("S")
        .compartment("I")
        .covariate("season", ["time"], rule=rule)
        .parameter("b", 1.0)
        .infection("S", "I", transmission="b * season", infectious=["I"])
        .build()
    )
    season = np.array([1.0, 2.0, 3.0, 4.0])
    _, inputs = model.precompute(model.init_params(2), {"season": season})
    assert isinstance(inputs, PiecewiseConstant)
    np.testing.assert_array_equal(inputs.times, np.arange(4) + offset)
    np.testing.assert_array_equal(inputs.values["infections[0].transmission"], season)
    # floor: day 1 holds on [1, 2); nearest: on [0.5, 1.5)
    assert inputs.index(1.2) == 1 and inputs.index(1.7) == (1 if rule == "floor" else 2)


def test_neural_with_time_input_is_evaluated_per_day_and_patch():
    model = compile_model(
        ModelBuilder("n")
        .compartment("S")
        .compartment("I")
        .covariate("mob", ["time", "patch", "feature"], rule="floor")
        .neural(
            "beta",
            "mob",
            in_size=3,
            width=5,
            depth=2,
            activation="tanh",
            time_input=True,
        )
        .infection("S", "I", transmission="beta", infectious=["I"])
        .build()
    )
    params = model.init_params(4, key=jax.random.key(3))
    mob = np.random.default_rng(0).uniform(size=(6, 4, 2))
    _, inputs = eqx.filter_jit(model.precompute)(params, {"mob": mob})
    beta = inputs.values["infections[0].transmission"]
    mlp = eqx.filter_jit(params["beta"])
    for day, patch in [(0, 0), (3, 2), (5, 3)]:
        x = jnp.concatenate([jnp.asarray(mob[day, patch]), jnp.array([float(day)])])
        np.testing.assert_allclose(beta[day, patch], mlp(x), rtol=1e-14)
    assert bool(jnp.all(beta > 0))  # softplus output by default


@pytest.mark.parametrize(
    ("transform", "bounds", "value", "closed_form"),
    [
        ("identity", None, -1.5, lambda x: x),
        ("exp", None, 2.0, np.exp),
        ("exp", [1.0, float("inf")], 2.0, lambda x: 1.0 + np.exp(x)),
        ("softplus", None, 0.3, lambda x: np.logaddexp(0, x)),
        ("softplus", [-1.0, float("inf")], 0.3, lambda x: -1.0 + np.logaddexp(0, x)),
        ("sigmoid", None, 0.2, lambda x: 1 / (1 + np.exp(-x))),
        ("sigmoid", [2.0, 5.0], 4.0, lambda x: 2.0 + 3.0 / (1 + np.exp(-x))),
    ],
)
def test_transforms_round_trip(transform, bounds, value, closed_form):
    model = compile_model(
        ModelBuilder("t")
        .compartment("A")
        .parameter("p", value, transform=transform, bounds=bounds)
        .build()
    )
    params = model.init_params(1)
    np.testing.assert_allclose(closed_form(float(params["p"])), value, rtol=1e-13)
    np.testing.assert_allclose(model.constrain(params)["p"], value, rtol=1e-13)
    back = model.unconstrain({"p": jnp.asarray(value)})
    np.testing.assert_allclose(back["p"], params["p"], rtol=1e-12, atol=1e-14)


def test_free_mask_partitions_fixed_parameters_and_activations():
    model = compile_model(load_model(MODELS / "seird_metapop_mobility.toml"))
    spec_fixed = compile_model(load_model(MODELS / "sir.toml"))
    mask = spec_fixed.free_mask(spec_fixed.init_params(1))
    assert mask == {"N": False, "beta": True, "gamma": True, "I0": True}
    params = model.init_params(3)
    free, static = eqx.partition(params, model.free_mask(params))
    assert (
        free["beta"].activation is None
        and static["beta"].activation is ACTIVATIONS["swish"]
    )
    assert free["beta"].layers[0].weight.shape == (7, 7)
    assert free["scaler"].shape == (3,)


def test_gradient_flows_through_precompute_and_vector_field():
    model = compile_model(load_model(MODELS / "seird_metapop_mobility.toml"))
    n, days = 4, 3
    rng = np.random.default_rng(0)
    covs = {
        "mobility": rng.uniform(size=(days, n, 7)),
        "coupling": rng.uniform(size=(days, n, n)),
    }
    params = model.init_params(n)
    y = {c: jnp.asarray(rng.uniform(size=s)) for c, s in model.state_shapes(n).items()}
    free, static = eqx.partition(params, model.free_mask(params))

    @eqx.filter_jit
    def loss(free):
        args, inputs = model.precompute(eqx.combine(free, static), covs)
        u = jtu.tree_map(lambda v: v[1], inputs.values)
        dy = model.vector_field(1.0, y, args, u)
        return sum(jnp.sum(v**2) for v in dy.values())

    grads = eqx.filter_grad(loss)(free)
    leaves = jtu.tree_leaves(grads)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)
    assert float(jnp.abs(grads["scaler"]).sum()) > 0
    assert float(jnp.abs(grads["beta"].layers[0].weight).sum()) > 0


def test_vector_field_keeps_state_dtype_under_jit():
    model = compile_model(load_model(MODELS / "seird_boxcar.toml"))
    args, u = model.precompute(model.init_params(2), {})
    y = {c: jnp.full(s, 0.1, jnp.float32) for c, s in model.state_shapes(2).items()}
    dy = jax.jit(model.vector_field)(0.0, y, args, u)
    assert jtu.tree_structure(dy) == jtu.tree_structure(y)
    assert all(v.dtype == jnp.float32 and v.shape == y[k].shape for k, v in dy.items())


def _random_covariates(model, n, days, rng):
    covs = {}
    for c in model.covariates:
        sizes = {"time": days, "patch": n, "patch_to": n, "feature": 7}
        covs[c.name] = rng.uniform(size=tuple(sizes[d] for d in c.dims))
    return covs


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_models_conserve_population(name):
    model = compile_model(load_model(MODELS / f"{name}.toml"))
    assert model.spec.closed
    rng = np.random.default_rng(0)
    n = 5
    params = model.init_params(n)
    args, inputs = model.precompute(params, _random_covariates(model, n, 4, rng))
    u = None if inputs is None else jtu.tree_map(lambda v: v[2], inputs.values)
    y = {c: jnp.asarray(rng.uniform(size=s)) for c, s in model.state_shapes(n).items()}
    dy = model.vector_field(2.0, y, args, u)
    total = sum(v.sum(axis=0) for v in dy.values())
    scale = sum(jnp.abs(v).sum(axis=0) for v in dy.values())
    np.testing.assert_array_less(np.abs(total), 1e-14 * np.asarray(scale))


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_specs_are_stable_values(name):
    a = load_model(MODELS / f"{name}.toml")
    b = load_model(MODELS / f"{name}.toml")
    assert isinstance(a, ModelSpec) and a == b and hash(a) == hash(b)
    assert a.path.endswith(f"{name}.toml")
    assert compile_model(a) == compile_model(b)  # static-only modules compare by value


def test_sir_builder_equals_toml():
    built = (
        ModelBuilder(
            "sir",
            description=(
                "SIR in counts, frequency-dependent transmission, one patch per "
                "population."
            ),
        )
        .compartment("S")
        .compartment("I")
        .compartment("R")
        .parameter("N", 763.0, fixed=True)
        .parameter("beta", 2.0, transform="softplus")
        .parameter("gamma", 0.5, transform="softplus")
        .parameter("I0", 1.0, transform="softplus")
        .derived("R0", "beta/gamma")
        .infection(
            "S",
            "I",
            transmission="beta",
            infectious=["I"],
            normalize="population",
            population="N",
        )
        .transition("I", "R", rate="gamma")
        .initial("S", "N - I0")
        .initial("I", "I0")
        .observation("in_bed", "prevalence", ["I"], family="least_squares")
        .build()
    )
    assert built == load_model(MODELS / "sir.toml")


def test_builder_round_trips_through_toml_text():
    spec = load_model(MODELS / "seird_metapop_mobility.toml")
    import tomllib

    data = tomllib.loads((MODELS / "seird_metapop_mobility.toml").read_text())
    assert builder_from_dict(data).build() == spec
    assert loads_model(to_toml(data)) == spec


def test_observe_incidence_sign_and_ascertainment():
    model = compile_model(
        ModelBuilder("o")
        .compartment("S")
        .compartment("I", stages=2)
        .parameter("rho", [0.5, 0.25], per_patch=True, transform="sigmoid")
        .observation("new", "incidence", ["S"], sign=-1, ascertainment="rho")
        .observation("prev", "prevalence", ["S", "I"])
        .build()
    )
    s = jnp.array(
        [[[10.0, 20.0]], [[7.0, 12.0]], [[3.0, 11.0]]]
    )  # (time, stage, patch)
    i = jnp.ones((3, 2, 2))
    params = model.init_params(2)
    raw = model.observe({"S": s, "I": i})
    np.testing.assert_allclose(raw["new"], [[3.0, 8.0], [4.0, 1.0]])
    np.testing.assert_allclose(raw["prev"], s[:, 0] + 2.0)
    seen = model.observe({"S": s, "I": i}, params)
    np.testing.assert_allclose(seen["new"], [[1.5, 2.0], [2.0, 0.25]], rtol=1e-12)
    np.testing.assert_allclose(seen["prev"], raw["prev"])


def test_precompute_and_initial_state_under_jit():
    model = compile_model(load_model(MODELS / "seird_metapop_mobility.toml"))
    rng = np.random.default_rng(0)
    covs = _random_covariates(model, 3, 5, rng)
    params = model.init_params(3)
    args, inputs = eqx.filter_jit(model.precompute)(params, covs)
    args2, inputs2 = model.precompute(params, covs)
    assert tree_allclose(args, args2) and tree_allclose(inputs.values, inputs2.values)
    np.testing.assert_array_equal(inputs.times, np.arange(5) - 0.5)


def test_neural_activations_pickle_to_themselves():
    """An MLP holds its activations, and an objective with a neural sub-model
    is pickled to the sampler's worker processes: every activation pickles
    by reference (JAX's own jitted and custom_jvp functions do not)."""
    import pickle

    x = jnp.linspace(-3.0, 3.0, 7)
    for name, fn in ACTIVATIONS.items():
        copy = pickle.loads(pickle.dumps(fn))
        assert copy is fn, name
        np.testing.assert_array_equal(np.asarray(copy(x)), np.asarray(fn(x)))
    assert ACTIVATIONS["swish"](x) == pytest.approx(np.asarray(jax.nn.swish(x)))
