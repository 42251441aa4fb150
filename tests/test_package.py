"""The top-level package: every curated name resolves, and the light entry
points (`import epifit.ode`, the CLI's argument parser) do not import the
data stack."""

import subprocess
import sys

import pytest

import epifit


@pytest.mark.parametrize("name", epifit.__all__)
def test_curated_names_resolve(name):
    value = getattr(epifit, name)
    assert value is not None
    assert name in dir(epifit)


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        epifit.nonsense  # noqa: B018


@pytest.mark.parametrize("stmt", ["import epifit.ode", "import epifit.cli"])
def test_light_imports_do_not_load_the_data_stack(stmt):
    heavy = ("xarray", "pandas", "optax")
    code = f"{stmt}; import sys; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_epifit_jit_compiles_with_its_options():
    from epifit._jit import compiler_options

    opts = compiler_options()
    assert isinstance(opts, dict)
    assert float(epifit.jit(lambda x: 2.0 * x)(3.0)) == 6.0
    # the options reach XLA (an unknown option would fail to compile)
    lowered = epifit.jit(lambda x: x + 1.0).lower(1.0)
    assert lowered.compile() is not None
