"""Property tests: generated models conserve population and both front doors agree;
malformed descriptions always raise `ModelSpecError` with a location."""

import copy
import keyword

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from helpers import MODELS, builder_from_dict, to_toml
from hypothesis import HealthCheck, event, given, settings

from epifit.model import ModelSpecError, compile_model, loads_model

FILE = "generated.toml"
SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

compartment_names = st.from_regex(r"[A-Z][a-z0-9]{0,4}", fullmatch=True).filter(
    lambda s: not keyword.iskeyword(s)
)


@st.composite
def valid_models(draw):
    """A random valid model in the TOML layout, and a patch count."""
    n_patches = draw(st.integers(1, 4))
    names = draw(st.lists(compartment_names, min_size=2, max_size=6, unique=True))
    stages = {c: draw(st.integers(1, 4)) for c in names}
    data = {
        "name": "generated",
        "compartments": [
            c
            if stages[c] == 1 and draw(st.booleans())
            else {"name": c, "stages": stages[c]}
            for c in names
        ],
        "parameters": {},
    }
    params = data["parameters"]

    def parameter(per_patch=None):
        name = f"p{len(params)}"
        entry = {
            "value": draw(st.floats(0.05, 0.95)),
            "transform": draw(
                st.sampled_from(["identity", "exp", "softplus", "sigmoid"])
            ),
        }
        if per_patch is None:
            per_patch = draw(st.booleans())
        if per_patch:
            entry["per_patch"] = True
            if draw(st.booleans()):
                entry["value"] = draw(
                    st.lists(
                        st.floats(0.05, 0.95), min_size=n_patches, max_size=n_patches
                    )
                )
        if draw(st.booleans()):
            entry["fixed"] = True
        params[name] = entry
        return name

    def rate():
        form = draw(st.integers(0, 2))
        if form == 0:
            return parameter()
        if form == 1:
            return f"{parameter()} * (1 + {parameter()})"
        return draw(st.floats(0.05, 2.0))

    transitions = []
    for c in names:
        if not draw(st.booleans()):
            continue  # absorbing
        others = [o for o in names if o != c]
        targets = draw(
            st.lists(
                st.sampled_from(others),
                min_size=1,
                max_size=min(3, len(others)),
                unique=True,
            )
        )
        t = {"from": c}
        if stages[c] > 1:
            t["rate_per"] = draw(st.sampled_from(["stage", "chain"]))
        if len(targets) == 1:
            t |= {"to": targets[0], "rate": rate()}
        elif draw(st.booleans()):
            t["rate"] = rate()
            t["branches"] = [
                {"to": x, "probability": f"0.5 * sigmoid({parameter()})"}
                for x in targets[:-1]
            ]
            t["branches"].append({"to": targets[-1]})
        else:
            t["branches"] = [{"to": x, "rate": rate()} for x in targets]
        transitions.append(t)
    data["transitions"] = transitions

    rule = draw(st.sampled_from(["floor", "nearest"]))
    covariates = {}
    if draw(st.integers(0, 3)) > 0:  # mostly with an infection
        source, target = draw(
            st.lists(st.sampled_from(names), min_size=2, max_size=2, unique=True)
        )
        chosen = draw(
            st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True)
        )
        infectious = []
        for c in chosen:
            entry = {"compartment": c}
            if stages[c] > 1 and draw(st.booleans()):
                entry["stages"] = draw(
                    st.lists(st.integers(1, stages[c]), min_size=1, unique=True)
                )
            if draw(st.booleans()):
                entry["weight"] = parameter()
            infectious.append(entry if len(entry) > 1 or draw(st.booleans()) else c)
        infection = {"from": source, "to": target, "infectious": infectious}
        if draw(st.booleans()):
            covariates["mob"] = {"dims": ["time", "patch", "feature"], "rule": rule}
            data["neural"] = {
                "net": {
                    "covariate": "mob",
                    "in_size": 3,
                    "width": 4,
                    "depth": draw(st.integers(0, 2)),
                    "activation": draw(st.sampled_from(["swish", "tanh", "relu"])),
                }
            }
            infection["transmission"] = draw(
                st.sampled_from(["net", f"net * {parameter()}"])
            )
        else:
            infection["transmission"] = parameter()
        if draw(st.booleans()):
            params["pop"] = {"value": draw(st.floats(1.0, 100.0)), "fixed": True}
            infection |= {"normalize": "population", "population": "pop"}
        if draw(st.booleans()):
            static = draw(st.booleans())
            covariates["cmat"] = (
                {"dims": ["patch", "patch_to"]}
                if static
                else {"dims": ["time", "patch", "patch_to"], "rule": rule}
            )
            coupling = {"covariate": "cmat"}
            if draw(st.booleans()):
                coupling["scale"] = parameter(per_patch=True)
            if draw(st.booleans()):
                coupling["symmetrize"] = True
            if draw(st.booleans()):
                coupling["multiplier"] = 2.0
            if draw(st.booleans()):
                coupling["local"] = draw(st.sampled_from([0.0, 0.5]))
            data["couplings"] = {"travel": coupling}
            infection["coupling"] = "travel"
        data["infections"] = [infection]
    if covariates:
        data["covariates"] = covariates
    data["initial"] = {names[0]: f"1 - {parameter(per_patch=False)}", names[1]: 0.25}
    # an incidence of a compartment that also gains is refused (it counts no
    # events): observe the level then
    gains = {t.get("to") for t in data.get("transitions", [])}
    gains |= {
        b.get("to") for t in data.get("transitions", []) for b in t.get("branches", [])
    }
    gains |= {i["to"] for i in data.get("infections", [])}
    second = (
        {"name": "inc", "kind": "prevalence", "compartments": [names[0]]}
        if names[0] in gains
        else {
            "name": "inc",
            "kind": "incidence",
            "compartments": [names[0]],
            "sign": -1,
        }
    )
    data["observations"] = [
        {"name": "prev", "kind": "prevalence", "compartments": [names[1]]},
        second,
    ]
    return data, n_patches


def random_covariates(model, n_patches, rng, n_days=3):
    sizes = {"time": n_days, "patch": n_patches, "patch_to": n_patches}
    strata = model.spec.strata
    if strata is not None:
        sizes |= {strata.name: strata.size, strata.to: strata.size}
    in_sizes = {n.covariate: n.in_size - int(n.time_input) for n in model.spec.neural}
    out = {}
    for c in model.covariates:
        dims = c.data_dims or c.dims  # as the data holds it
        shape = tuple(
            in_sizes.get(c.name, 1) if d == "feature" else sizes[d] for d in dims
        )
        x = rng.uniform(0.0, 1.0, size=shape)
        if strata is not None and strata.name in dims and "patch" in dims:
            # (.., patch, stratum) onto the cells, patch-major, as Problem does
            x = x.reshape(*shape[: dims.index("patch")], -1)
        out[c.name] = x
    return out


def evaluate(model, n_patches, seed):
    # bound as Problem binds it: a stratified model's per-stratum values
    # are tiled over the patches onto the cells (patch-major), and a model
    # with time-varying parameters to the covariates' 3 days
    model = model.bind_patches(n_patches).bind_days(3)
    n_cells = n_patches * model.n_strata
    rng = np.random.default_rng(seed)
    params = model.init_params(n_patches, key=jax.random.key(seed))
    covariates = random_covariates(model, n_patches, rng)
    args, inputs = model.precompute(params, covariates, n_cells)
    u = None if inputs is None else jtu.tree_map(lambda v: v[1], inputs.values)
    y = {
        c: jnp.asarray(rng.uniform(0.0, 1.0, size=s))
        for c, s in model.state_shapes(n_cells).items()
    }
    return y, model.vector_field(1.2, y, args, u), params


@settings(max_examples=30, deadline=None)
@given(valid_models(), st.integers(0, 2**16))
def test_generated_models_conserve_and_front_doors_agree(model_and_patches, seed):
    data, n_patches = model_and_patches
    inf = data.get("infections", [{}])[0]
    event(
        f"infection={bool(inf)} coupling={'coupling' in inf} neural={'neural' in data}"
    )
    event(f"branching={any('branches' in t for t in data['transitions'])}")
    from_toml = loads_model(to_toml(data), path=FILE)
    from_builder = builder_from_dict(data).build()
    assert from_toml == from_builder

    y, dy, params = evaluate(compile_model(from_toml), n_patches, seed)
    _, dy_b, _ = evaluate(compile_model(from_builder), n_patches, seed)
    assert jtu.tree_structure(dy) == jtu.tree_structure(y)
    for name in y:
        assert dy[name].shape == y[name].shape and dy[name].dtype == y[name].dtype
        np.testing.assert_array_equal(dy[name], dy_b[name])
        assert bool(jnp.all(jnp.isfinite(dy[name])))

    # a closed model (the generator writes no inflows or outflows; open
    # populations are tested in test_open_population.py): the derivatives
    # sum to zero per patch, to rounding
    assert from_toml.closed
    total = sum(v.sum(axis=0) for v in dy.values())
    scale = sum(jnp.abs(v).sum(axis=0) for v in dy.values())
    np.testing.assert_array_less(np.abs(total), 1e-13 * np.asarray(scale) + 1e-300)


# -- malformed descriptions -----------------------------------------------------------
REQUIRED = {
    "compartments": ("name",),
    "transitions": ("from",),
    "infections": ("from", "to", "transmission", "infectious"),
    "observations": ("name", "kind", "compartments"),
    "parameters": ("value",),
    "covariates": ("dims",),
    "neural": ("covariate",),
    "couplings": ("covariate",),
}
BAD_EXPRESSIONS = [
    "a.b",
    "x[0]",
    "lambda: 1",
    "'s'",
    "exp(",
    "foo(1)",
    "__import__('os')",
    "p0 if p0 else 1",
    "",
]
EXPRESSION_FIELDS = {
    "rate",
    "probability",
    "transmission",
    "population",
    "scale",
    "weight",
    "ascertainment",
}
REFERENCE_FIELDS = {"from", "to", "compartment"}


def leaves(obj, path=()):
    """All (path, value) pairs below a nested dict/list."""
    items = (
        obj.items()
        if isinstance(obj, dict)
        else enumerate(obj)
        if isinstance(obj, list)
        else ()
    )
    for k, v in items:
        yield (*path, k), v
        yield from leaves(v, (*path, k))


def set_at(data, path, value):
    target = data
    for k in path[:-1]:
        target = target[k]
    if value is ...:
        del target[path[-1]]
    else:
        target[path[-1]] = value


def shipped_descriptions():
    import tomllib

    docs = [tomllib.loads(p.read_text()) for p in sorted(MODELS.glob("*.toml"))]
    # models/ also holds fit configurations and scenario files: models only
    return [d for d in docs if "compartments" in d]


descriptions = st.one_of(
    valid_models().map(lambda d: d[0]), st.sampled_from(shipped_descriptions())
)


def assert_located(err: ModelSpecError):
    assert err.file == FILE and err.location, str(err)
    assert str(err).startswith(f"{FILE}: {err.location}: ")


@st.composite
def invalid_mutations(draw):
    """A description with one mutation that is always invalid."""
    data = copy.deepcopy(draw(descriptions))
    paths = list(leaves(data))
    kind = draw(
        st.sampled_from(
            ["delete", "table", "reference", "stages", "expression", "field"]
        )
    )
    if kind == "delete":
        # entries of [[list]] sections and of [named] sections: (section, i or name)
        candidates = [
            p
            for p, v in paths
            if len(p) == 2 and p[0] in REQUIRED and isinstance(v, dict)
        ]
        if candidates:
            p = draw(st.sampled_from(candidates))
            key = draw(
                st.sampled_from([k for k in REQUIRED[p[0]] if k in dict_at(data, p)])
            )
            set_at(data, (*p, key), ...)
            return data
        kind = "table"
    if kind == "reference":
        refs = [p for p, v in paths if p[-1] in REFERENCE_FIELDS and isinstance(v, str)]
        refs += [
            p
            for p, v in paths
            if len(p) >= 2
            and p[-2] == "compartments"
            and isinstance(v, str)
            and p[0] == "observations"
        ]
        if refs:
            set_at(data, draw(st.sampled_from(refs)), "Zz9")
            return data
        kind = "table"
    if kind == "stages":
        i = draw(st.integers(0, len(data["compartments"]) - 1))
        entry = data["compartments"][i]
        name = entry if isinstance(entry, str) else entry["name"]
        data["compartments"][i] = {
            "name": name,
            "stages": draw(st.sampled_from([-3, -1, 0, 1.5, "2", True])),
        }
        return data
    if kind == "expression":
        exprs = [
            p
            for p, v in paths
            if p[-1] in EXPRESSION_FIELDS and not isinstance(v, dict | list)
        ]
        exprs += [p for p, v in paths if p[0] == "derived" and len(p) == 2]
        if exprs:
            set_at(
                data,
                draw(st.sampled_from(exprs)),
                draw(st.sampled_from(BAD_EXPRESSIONS)),
            )
            return data
        kind = "table"
    if kind == "field":
        tables = [
            p
            for p, v in paths
            if isinstance(v, dict)
            and p[0]
            not in (
                "parameters",
                "covariates",
                "neural",
                "couplings",
                "initial",
                "derived",
            )
            or len(p) == 2
            and isinstance(v, dict)
            and p[0] != "initial"
        ]
        if tables:
            set_at(data, (*draw(st.sampled_from(tables)), "bogus_field"), 1)
        else:
            data["bogus_field"] = 1
        return data
    # a table where a scalar or a list belongs: never valid
    scalars = [p for p, v in paths if not isinstance(v, dict)]
    set_at(data, draw(st.sampled_from(scalars)), {"bogus": 1})
    return data


def dict_at(data, path):
    for k in path:
        data = data[k]
    return data


@SETTINGS
@given(invalid_mutations())
def test_invalid_mutations_raise_located_model_spec_error(data):
    event(f"sections: {sorted(k for k in data if isinstance(data[k], dict | list))}")
    try:
        loads_model(to_toml(data), path=FILE)
    except ModelSpecError as err:
        event(f"error at: {err.location.split('.')[0].split('[')[0]}")
        assert_located(err)
    else:
        raise AssertionError(f"no error for:\n{to_toml(data)}")


toml_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.sampled_from(
        ["S", "I", "E", "p0", "kappa", "nan", "exp(", "stage", "chain", "time"]
    ),
    st.lists(st.integers(-2, 9), max_size=4),
    st.lists(st.text(max_size=3), max_size=3),
    st.dictionaries(
        st.sampled_from(["to", "rate", "data", "x"]), st.text(max_size=3), max_size=2
    ),
)


@SETTINGS
@given(descriptions, st.data())
def test_random_edits_never_raise_anything_else(data, draw):
    data = copy.deepcopy(data)
    for _ in range(draw.draw(st.integers(1, 3))):
        paths = [p for p, _ in leaves(data)]
        if not paths:
            break
        path = draw.draw(st.sampled_from(paths))
        value = draw.draw(toml_values)
        set_at(data, path, ... if value is None else value)
    try:
        spec = loads_model(to_toml(data), path=FILE)
    except ModelSpecError as err:
        event("rejected")
        assert_located(err)
        return
    event("accepted")
    # what loads also compiles and evaluates (or fails with a located error)
    try:
        evaluate(compile_model(spec), 2, 0)
    except ModelSpecError as err:
        assert err.location


@SETTINGS
@given(st.sampled_from(sorted(MODELS.glob("*.toml"))), st.data())
def test_damaged_toml_text_never_raises_anything_else(path, draw):
    text = path.read_text()
    start = draw.draw(st.integers(0, len(text) - 1))
    length = draw.draw(st.integers(1, 20))
    insert = draw.draw(st.sampled_from(["", "=", "[", "]", '"', "{", "\n", "x"]))
    damaged = text[:start] + insert + text[start + length :]
    try:
        loads_model(damaged, path=FILE)
    except ModelSpecError as err:
        assert_located(err)
