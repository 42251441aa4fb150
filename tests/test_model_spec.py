"""Model specification errors: every one names the file, the field and the fault."""

import copy
import re

import numpy as np
import pytest
from helpers import MODELS, to_toml

from epifit.model import (
    ModelBuilder,
    ModelSpecError,
    compile_model,
    load_model,
    loads_model,
)

FILE = "models/x.toml"

BASE = {
    "name": "x",
    "compartments": ["S", "E", "I", "R"],
    "parameters": {
        "N": {"value": 100.0, "fixed": True},
        "beta": {"value": 0.5, "transform": "softplus"},
        "sigma": {"value": 0.2, "transform": "softplus"},
        "gamma": {"value": 0.1, "transform": "softplus"},
        "omega": {"value": 0.01, "transform": "exp"},
    },
    "transitions": [
        {"from": "E", "to": "I", "rate": "sigma"},
        {"from": "I", "to": "R", "rate": "gamma"},
        {"from": "R", "to": "S", "rate": "omega"},
    ],
    "infections": [
        {"from": "S", "to": "E", "transmission": "beta", "infectious": ["I"]}
    ],
    "initial": {"S": "N - 1", "I": 1.0},
}

METAPOP = {
    "name": "m",
    "compartments": ["S", {"name": "I", "stages": 3}, "R"],
    "parameters": {
        "gamma": {"value": 0.3, "transform": "softplus"},
        "scale": {"value": 1.0, "transform": "softplus", "per_patch": True},
    },
    "covariates": {
        "mobility": {"dims": ["time", "patch", "feature"], "rule": "floor"},
        "travel": {"dims": ["time", "patch", "patch_to"], "rule": "floor"},
    },
    "neural": {"beta": {"covariate": "mobility", "layers": [2, 4, 4, 1]}},
    "couplings": {"c": {"covariate": "travel", "scale": "scale"}},
    "transitions": [{"from": "I", "to": "R", "rate": "gamma", "rate_per": "chain"}],
    "infections": [
        {
            "from": "S",
            "to": "I",
            "transmission": "beta",
            "infectious": ["I"],
            "coupling": "c",
        }
    ],
}


def load(base=BASE, **edits):
    """Load `base` with dotted-path edits (value `...` deletes)."""
    data = copy.deepcopy(base)
    for path, value in edits.items():
        keys = [int(k) if k.isdigit() else k for k in path.split("__")]
        target = data
        for k in keys[:-1]:
            target = target[k]
        if value is ...:
            del target[keys[-1]]
        else:
            target[keys[-1]] = value
    return loads_model(to_toml(data), path=FILE)


def raises(match):
    return pytest.raises(ModelSpecError, match=match)


def test_base_models_are_valid():
    assert load().name == "x"
    assert load(METAPOP).name == "m"


def test_unknown_compartment_message_is_exact():
    with pytest.raises(ModelSpecError) as info:
        load(transitions__2__to="Q")
    assert str(info.value) == (
        "models/x.toml: transitions[2].to: unknown compartment 'Q'; known: S, E, I, R"
    )
    assert info.value.file == FILE and info.value.location == "transitions[2].to"


def test_error_names_the_file_on_disk(tmp_path):
    path = tmp_path / "bad.toml"
    data = copy.deepcopy(BASE)
    data["transitions"][0]["from"] = "Z"
    path.write_text(to_toml(data))
    with raises(re.escape(f"{path}: transitions[0].from: unknown compartment 'Z'")):
        load_model(path)


def test_compartment_left_twice_without_branching():
    data = copy.deepcopy(BASE)
    data["transitions"].append({"from": "E", "to": "R", "rate": "gamma"})
    with raises(
        r"transitions\[3\]\.from: compartment 'E' is already left by transitions\[0\]"
        r".*branches"
    ):
        loads_model(to_toml(data), path=FILE)


@pytest.mark.parametrize(
    ("stages", "match"),
    [
        (-2, r"compartments\[1\]\.stages: must be an integer >= 1, got -2"),
        (0, r"compartments\[1\]\.stages: must be an integer >= 1, got 0"),
        (True, r"compartments\[1\]\.stages: expected an integer, got bool"),
        (2.5, r"compartments\[1\]\.stages: expected an integer, got float"),
        (10**6, r"compartments\[1\]\.stages: more than 10000 stages"),
    ],
)
def test_bad_stage_counts(stages, match):
    with raises(match):
        load(compartments__1={"name": "E", "stages": stages})


def test_unknown_parameter_in_expression():
    with raises(
        r"transitions\[1\]\.rate: unknown name 'gama' in expression 'gama'; "
        r"known: S, E, I, R, N, beta, sigma, gamma, omega"
    ):
        load(transitions__1__rate="gama")


def test_bad_expression_names_the_token():
    with raises(r"infections\[0\]\.transmission: .*'beta\.real' \(Attribute\)"):
        load(infections__0__transmission="beta.real")
    with raises(r"derived\.eta: .*unknown function 'eval'"):
        load(derived={"eta": "eval('1')"})


def test_malformed_toml_names_file_and_line():
    text = to_toml(BASE).replace('name = "x"', 'name = "x"\nbeta = = 1')
    with raises(r"^models/x\.toml: line 2: invalid TOML: .*line 2"):
        loads_model(text, path=FILE)


def test_unknown_fields():
    with raises(r"^models/x\.toml: colour: unknown field 'colour'; expected one of"):
        load(colour="red")
    with raises(r"parameters\.beta\.trasform: unknown field 'trasform'"):
        load(parameters__beta__trasform="softplus")


def test_missing_required_fields():
    with raises(r"compartments: missing required field 'compartments'"):
        load(compartments=...)
    with raises(r"transitions\[0\]\.rate: missing required field 'rate'"):
        load(transitions__0__rate=...)
    with raises(r"infections\[0\]\.infectious: missing required field"):
        load(infections__0__infectious=...)


def test_wrong_types():
    with raises(r"parameters\.beta\.value: expected a number, got str '0.5'"):
        load(parameters__beta__value="0.5")
    with raises(r"parameters\.N\.fixed: expected true or false, got int 1"):
        load(parameters__N__fixed=1)
    with raises(r"parameters: expected a table of named entries"):
        load(parameters=[1, 2])
    with raises(r"transitions\[0\]: expected a table, got int 3"):
        load(transitions=[3])


def test_chain_needs_explicit_rate_per():
    with raises(r"transitions\[1\]\.rate_per: required because 'I' has 4 stages"):
        load(compartments__2={"name": "I", "stages": 4})
    assert load(
        compartments__2={"name": "I", "stages": 4}, transitions__1__rate_per="chain"
    )
    with raises(r"transitions\[1\]\.rate_per: unknown value 'box'"):
        load(transitions__1__rate_per="box")


def test_branching_errors():
    both = [{"to": "I", "probability": 0.3}, {"to": "R", "probability": 0.7}]
    with raises(r"transitions\[0\]\.branches: exactly one branch must omit"):
        load(transitions__0={"from": "E", "rate": "sigma", "branches": both})
    mixed = [{"to": "I", "rate": "sigma"}, {"to": "R"}]
    with raises(r"transitions\[0\]\.branches\[0\]\.rate: the transition has a `rate`"):
        load(transitions__0={"from": "E", "rate": "sigma", "branches": mixed})
    with raises(r"transitions\[0\]\.branches\[1\]\.rate: missing"):
        load(transitions__0={"from": "E", "branches": mixed})
    with raises(r"transitions\[0\]\.branches: a split needs at least two branches"):
        load(transitions__0={"from": "E", "rate": "sigma", "branches": [{"to": "I"}]})
    dup = [{"to": "I", "probability": 0.5}, {"to": "I"}]
    with raises(r"transitions\[0\]\.branches\[1\]\.to: two branches lead to 'I'"):
        load(transitions__0={"from": "E", "rate": "sigma", "branches": dup})
    with raises(r"transitions\[0\]: give exactly one of `to` and `branches`"):
        load(transitions__0={"from": "E", "to": "I", "rate": "sigma", "branches": dup})


def test_self_loops():
    with raises(r"transitions\[0\]\.to: 'E' cannot flow into itself"):
        load(transitions__0__to="E")
    with raises(r"infections\[0\]\.to: 'S' cannot infect into itself"):
        load(infections__0__to="S")


def test_infectious_stages_out_of_range():
    with raises(
        r"infectious\[0\]\.stages: stage 2 does not exist: 'I' has stages 1\.\.1"
    ):
        load(infections__0__infectious=[{"compartment": "I", "stages": [1, 2]}])
    with raises(r"infectious\[0\]\.stages\[0\]: must be an integer >= 1, got 0"):
        load(infections__0__infectious=[{"compartment": "I", "stages": [0]}])


def test_population_normalisation_needs_population():
    with raises(r"infections\[0\]\.population: missing; normalize = \"population\""):
        load(infections__0__normalize="population")
    with raises(r"infections\[0\]\.population: used only with normalize"):
        load(infections__0__population="N")


def test_unknown_coupling():
    with raises(r"infections\[0\]\.coupling: unknown coupling 'd'; known: c"):
        load(METAPOP, infections__0__coupling="d")


def test_covariate_errors():
    with raises(r"covariates\.travel\.dims: unsupported dims \['time', 'patch', 'x'\]"):
        load(METAPOP, covariates__travel__dims=["time", "patch", "x"])
    with raises(r"covariates\.travel\.rule: missing required field 'rule'"):
        load(METAPOP, covariates__travel__rule=...)
    with raises(r"covariates\.travel\.rule: rule 'nearest' differs from rule 'floor'"):
        load(METAPOP, covariates__travel__rule="nearest")
    with raises(r"covariates\.w: 'w' is declared but never used"):
        load(METAPOP, covariates__w={"dims": ["patch"]})
    with raises(r"couplings\.c\.covariate: 'mobility' is not a covariate with dims"):
        load(METAPOP, couplings__c__covariate="mobility")
    with raises(r"neural\.beta\.covariate: 'travel' is not a covariate with dims"):
        load(METAPOP, neural__beta__covariate="travel")


def test_neural_errors():
    with raises(r"neural\.beta\.layers: hidden layers must all have the same width"):
        load(METAPOP, neural__beta__layers=[2, 4, 3, 1])
    with raises(r"neural\.beta\.layers: layers are \[in_size, hidden\.\.\., 1\]"):
        load(METAPOP, neural__beta__layers=[2, 4, 2])
    with raises(r"neural\.beta\.width: give either `layers` or"):
        load(METAPOP, neural__beta__width=4)
    with raises(r"neural\.beta\.activation: unknown value 'gelu'; expected one of"):
        load(METAPOP, neural__beta__activation="gelu")
    with raises(
        r"neural\.beta\.fixed: expected one of: true, false, 'hidden'; got str 'last'"
    ):
        load(METAPOP, neural__beta__fixed="last")


def test_neural_hidden_layers_fixed():
    """`fixed = "hidden"`: the free mask holds the output layer's weight and
    bias only (layers [2, 4, 4, 1]: 4 + 1 of 37); `true` none of the MLP."""
    import jax

    for fixed, free in ((False, 37), (True, 0), ("hidden", 5)):
        model = compile_model(load(METAPOP, neural__beta__fixed=fixed))
        params = model.init_params(n_patches=2)
        mask = model.free_mask(params)["beta"]
        n = sum(
            leaf.size
            for leaf, m in zip(
                jax.tree.leaves(params["beta"]), jax.tree.leaves(mask), strict=True
            )
            if m
        )
        assert n == free, fixed
        assert model.spec.neural[0].fixed == fixed


def test_names_share_one_namespace():
    with raises(r"parameters\.I: name 'I' is already used by a compartment"):
        load(parameters__I={"value": 1.0})
    with raises(r"parameters\.exp: parameter name 'exp' would shadow the function"):
        load(parameters__exp={"value": 1.0})
    with raises(r"compartments\[0\]\.name: compartment name 'S-1' is not a valid"):
        load(compartments__0="S-1")


def test_derived_errors():
    with raises(r"derived\.a: circular definition: a -> b -> a"):
        load(derived={"a": "b + 1", "b": "2 * a"})
    with raises(
        r"derived\.x: 'beta' \(a neural sub-model\) cannot be used in a derived"
    ):
        load(METAPOP, derived={"x": "beta * 2"})


def test_parameter_errors():
    with raises(r"parameters\.p\.bounds: transform 'sigmoid' needs finite bounds"):
        load(
            parameters__p={
                "value": 0.5,
                "transform": "sigmoid",
                "bounds": [0, float("inf")],
            }
        )
    with raises(
        r"parameters\.beta\.bounds: transform 'softplus' maps onto \(lower, inf\)"
    ):
        load(parameters__beta__bounds=[0.0, 2.0])
    with raises(
        r"parameters\.beta\.value: value -0\.5 must lie strictly inside \(0\.0, inf\)"
    ):
        load(parameters__beta__value=-0.5)
    with raises(
        r"parameters\.N\.value: value 100\.0 lies outside bounds \[0\.0, 10\.0\]"
    ):
        load(parameters__N__bounds=[0.0, 10.0])
    with raises(r"parameters\.beta\.value: a list of values needs per_patch = true"):
        load(parameters__beta__value=[0.5, 0.6])
    with raises(r"parameters\.beta\.value: expected a finite number, got nan"):
        load(parameters__beta__value=float("nan"))


def test_observation_errors():
    obs = {"name": "cases", "kind": "flow", "transition": "S->E"}
    assert load(observations=[obs]).observations[0].transition == ("S", "E")
    inc = {"name": "cases", "kind": "incidence", "compartments": ["S"], "sign": -1}
    with raises(r"observations\[0\]\.compartments\[0\]: unknown compartment 'Q'"):
        load(observations=[{**inc, "compartments": ["Q"]}])
    with raises(r"observations\[0\]\.dispersion: missing; a negative binomial"):
        load(observations=[{**obs, "family": "negative_binomial"}])
    with raises(r"observations\[0\]\.dispersion: a poisson likelihood has no"):
        load(observations=[{**obs, "family": "poisson", "dispersion": "N"}])
    with raises(r"observations\[0\]\.dispersion: unknown parameter 'k'"):
        load(observations=[{**obs, "family": "negative_binomial", "dispersion": "k"}])
    with raises(r"observations\[0\]\.sign: applies only to kind = \"incidence\""):
        load(observations=[{**obs, "sign": -1}])
    with raises(r"observations\[0\]\.sign: must be 1 or -1, got 2"):
        load(observations=[{**inc, "sign": 2}])
    with raises(r"observations\[1\]\.name: data variable 'cases' observed twice"):
        load(observations=[obs, obs])
    with raises(r"observations\[0\]\.weight: must be > 0"):
        load(observations=[{**obs, "weight": 0.0}])


def test_initial_errors():
    with raises(r"initial\.Q: unknown compartment 'Q'"):
        load(initial__Q="1")
    with raises(r"initial\.S: give exactly one of `expression` and `data`"):
        load(initial__S={})
    with raises(r"initial\.S: unknown name 'M'"):
        load(initial__S="M - 1")


def test_covariate_shape_mismatch_at_precompute():
    model = compile_model(load(METAPOP))
    params = model.init_params(3)
    good = {"mobility": np.ones((5, 3, 2)), "travel": np.ones((5, 3, 3))}
    model.precompute(params, good)
    with raises(r"covariates\.mobility: shape \(5, 3, 7\): 7 features, but neural"):
        model.precompute(params, {**good, "mobility": np.ones((5, 3, 7))})
    with raises(r"covariates\.travel: time size 6 disagrees with time size 5"):
        model.precompute(params, {**good, "travel": np.ones((6, 3, 3))})
    with raises(r"covariates\.mobility: patch size 4 disagrees with patch size 3 of"):
        model.precompute(params, {**good, "mobility": np.ones((5, 4, 2))})
    with raises(r"covariates\.travel: shape \(3, 3\) does not match dims"):
        model.precompute(params, {**good, "travel": np.ones((3, 3))})
    with raises(r"covariates\.travel: no covariate 'travel' given; found: mobility"):
        model.precompute(params, {"mobility": good["mobility"]})


def test_per_patch_value_count_checked_at_init():
    spec = load(METAPOP, parameters__scale__value=[1.0, 2.0])
    assert compile_model(spec).init_params(2)["scale"].shape == (2,)
    with raises(r"parameters\.scale\.value: has 2 per-patch values but n_patches = 3"):
        compile_model(spec).init_params(3)


def test_initial_state_data_errors():
    spec = load(initial={"S": {"data": "s0"}, "I": {"data": "i0"}})
    model = compile_model(spec)
    params = model.init_params(2)
    with raises(r"initial\.S: no data variable 's0'; found: i0"):
        model.initial_state(params, {"i0": np.ones(2)}, 2)
    with raises(r"initial\.I: data variable 'i0' has shape \(3,\); expected"):
        model.initial_state(params, {"s0": np.ones(2), "i0": np.ones(3)}, 2)


def test_missing_and_unreadable_files(tmp_path):
    with raises(r"nope\.toml: no such model file; \.toml files in .*: .*\bseir\.toml"):
        load_model(MODELS / "nope.toml")
    bad = tmp_path / "latin1.toml"
    bad.write_bytes(b'name = "caf\xe9"\n')
    with raises(r"latin1\.toml: not UTF-8 text"):
        load_model(bad)


def test_name_defaults_to_file_stem(tmp_path):
    data = {k: v for k, v in BASE.items() if k != "name"}
    path = tmp_path / "my_model.toml"
    path.write_text(to_toml(data))
    assert load_model(path).name == "my_model"
    with raises(r"name: missing required field 'name'"):
        loads_model(to_toml(data))


def test_builder_errors_name_the_builder():
    b = ModelBuilder("b").compartment("S").parameter("a", 1.0)
    with raises(r"^ModelBuilder: parameters\.a: 'a' is defined twice"):
        b.parameter("a", 2.0)
    with raises(r"^ModelBuilder: transitions\[0\]\.to: unknown compartment 'I'"):
        b.transition("S", "I", rate="a").build()
