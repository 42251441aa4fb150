"""Profile likelihoods on the boarding-school SIR: against the Laplace
intervals, against a brute-force profile written here with SciPy alone
(`solve_ivp` and Nelder-Mead at every grid point, each started afresh from the
fitted point), one compiled program for the whole profile, a structurally
flat profile reported as not identifiable, and `PROFILE.nc` read back."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import re
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest
import xarray as xr
from scipy.integrate import solve_ivp
from scipy.optimize import least_squares

from epifit.cli import main
from epifit.fitting import (
    Objective,
    Profile,
    ProfileError,
    calibrate,
    plot_profile,
    profile,
)
from epifit.fitting._profile import _entry_transform, profile_objective
from epifit.fitting._profile_result import crossings

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "models" / "sir.toml"
DATA = REPO / "data" / "boarding_school_1978.nc"
FIT = REPO / "models" / "sir_fit.toml"
IN_BED = np.array([3, 8, 26, 76, 225, 298, 258, 233, 189, 128, 68, 29, 14, 4.0])
N = 763.0
CUT = 1.9207294103470618  # chi2_1(0.95) / 2
TOL_PARAMS = 1e-5  # measured 5.6e-7 (I0), 8.3e-8 (beta)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "FIT.nc"
    fit = calibrate(MODEL, DATA, fit=FIT, progress=False)
    fit.to_netcdf(path)
    return fit, path


class _Compiles(logging.Handler):
    """The names of the functions XLA compiles (from `jax.log_compiles`)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.names = []

    def emit(self, record):
        msg = record.getMessage()
        if msg.startswith("Finished XLA compilation of "):
            self.names.append(msg.split(" of ", 1)[1].rsplit(" in ", 1)[0])


@pytest.fixture(scope="module")
def gamma(fitted):
    """The profile of gamma from the FIT.nc, counting compilations and the
    objective's evaluations outside compiled code while it runs."""
    _, path = fitted
    handler = _Compiles()
    logger = logging.getLogger("jax")
    logger.addHandler(handler)
    eager = []
    original = Objective.data_loss

    def counted(self, x, data):
        if not isinstance(x, jax.core.Tracer):
            eager.append(x)
        return original(self, x, data)

    Objective.data_loss = counted
    try:
        with jax.log_compiles():
            prof = profile(path, "gamma")
    finally:
        Objective.data_loss = original
        logger.removeHandler(handler)
    return prof, handler.names, eager


# -- the brute-force reference: SciPy alone ---------------------------------------
def _softplus(x):
    return np.logaddexp(0.0, x)


def _softplus_inverse(y):
    return y + np.log(-np.expm1(-y))


def _residuals(beta, gamma, i0):
    def f(t, u):
        s, i = u
        new = beta * s * i / N
        return [-new, new - gamma * i]

    sol = solve_ivp(
        f,
        (0.0, 13.0),
        [N - i0, i0],
        t_eval=np.arange(14.0),
        method="DOP853",
        rtol=1e-11,
        atol=1e-9,
    )
    return sol.y[1] - IN_BED


def _ssr(beta, gamma, i0):
    return float(np.sum(np.square(_residuals(beta, gamma, i0))))


def _brute_force(grid, start):
    """`min over (I0, beta) of SSR` at each gamma of `grid` (SciPy's
    Levenberg-Marquardt on the softplus scale, from the fitted point each
    time: no warm start), the optima, and the minimum over all three."""

    def at(g):
        def r(z):
            return _residuals(_softplus(z[1]), g, _softplus(z[0]))

        res = least_squares(r, start, method="lm", xtol=1e-14, ftol=1e-14)
        return 2.0 * res.cost, _softplus(res.x)

    def full(z):
        return _residuals(_softplus(z[1]), _softplus(z[2]), _softplus(z[0]))

    best = least_squares(full, np.r_[start, -0.55], method="lm", xtol=1e-14, ftol=1e-14)
    fun, z = zip(*(at(g) for g in grid), strict=True)
    return np.array(fun), np.array(z), 2.0 * best.cost


# -- tests ---------------------------------------------------------------------------
def test_gamma_profile_agrees_with_laplace_and_brute_force(fitted, gamma):
    fit, _ = fitted
    prof, _, _ = gamma
    assert prof.parameter == "gamma" and prof.grid.size == 21
    assert prof.converged.all() and prof.identified
    assert prof.cut == pytest.approx(CUT, rel=1e-12)
    row = fit.intervals["gamma"]
    assert prof.estimate == pytest.approx(row["estimate"], rel=1e-12)
    assert (prof.laplace_lower, prof.laplace_upper) == (row["lower"], row["upper"])
    # within 5% of the Laplace interval: each end, and the width
    for a, b in ((prof.lower, row["lower"]), (prof.upper, row["upper"])):
        assert abs(a - b) <= 0.05 * abs(b)
    width, lap_width = prof.upper - prof.lower, row["upper"] - row["lower"]
    assert abs(width - lap_width) <= 0.05 * lap_width
    # the grid spans +-4 Laplace standard errors on the transformed scale
    se = math.sqrt(fit.covariance[2, 2])
    assert fit.labels[2] == "gamma"
    np.testing.assert_allclose(
        prof.grid_x, fit.x[2] + np.linspace(-4, 4, 21) * se, rtol=0, atol=1e-12
    )
    assert prof.delta[0] > 4 * CUT and prof.delta[-1] > 3 * CUT

    # the brute-force profile of the sum of squares, scaled by its own noise
    # variance SSR_min / (n - p) as the Laplace approximation is
    ssr, optima, ssr_min = _brute_force(prof.grid, np.asarray(fit.x[:2]))
    assert ssr_min == pytest.approx(fit.loss, rel=1e-7)
    ref = ssr / (2.0 * ssr_min / (14 - 3))
    ref_delta = ref - ref.min()
    # solver (rtol 1e-8 against 1e-11) and optimiser tolerances (1e-9): the
    # profile values (0 to 10) agree to 4.4e-8 as measured
    np.testing.assert_allclose(prof.delta, ref_delta, rtol=0, atol=1e-6)
    lo, hi, _ = crossings(np.log(np.expm1(prof.grid)), ref_delta, CUT, 10)
    assert prof.lower == pytest.approx(_softplus(lo), rel=1e-7)
    assert prof.upper == pytest.approx(_softplus(hi), rel=1e-7)
    # the re-optimised I0 and beta at each point are the brute-force optima
    est = {k: prof.estimates[:, i] for i, k in enumerate(prof.estimate_labels)}
    np.testing.assert_allclose(est["I0"], optima[:, 0], rtol=TOL_PARAMS)
    np.testing.assert_allclose(est["beta"], optima[:, 1], rtol=TOL_PARAMS)
    np.testing.assert_allclose(est["gamma"], prof.grid, rtol=1e-12)
    np.testing.assert_allclose(est["R0"], est["beta"] / prof.grid, rtol=1e-12)


def test_the_whole_profile_is_one_compiled_program(gamma):
    _, names, eager = gamma
    assert names.count("jit(run)") == 1
    # nothing else evaluates the objective: every solve is inside the program
    assert eager == []


def test_beta_profile_agrees_with_laplace(fitted):
    fit, _ = fitted
    prof = profile(fit, "beta", points=11)
    row = fit.intervals["beta"]
    assert prof.converged.all() and prof.identified
    for a, b in ((prof.lower, row["lower"]), (prof.upper, row["upper"])):
        assert abs(a - b) <= 0.05 * abs(b)
    width, lap_width = prof.upper - prof.lower, row["upper"] - row["lower"]
    assert abs(width - lap_width) <= 0.05 * lap_width


def test_profile_file_round_trip_and_plot(gamma, tmp_path):
    prof, _, _ = gamma
    path = prof.to_netcdf(tmp_path / "PROFILE.nc")
    back = Profile.from_netcdf(path)
    for name in ("grid", "grid_x", "value", "delta", "x", "estimates", "converged"):
        np.testing.assert_array_equal(getattr(back, name), getattr(prof, name))
    for name in ("parameter", "lower", "upper", "identifiable", "laplace_lower"):
        assert getattr(back, name) == getattr(prof, name)
    assert back.free_labels == ["I0", "beta", "gamma"]
    assert back.attrs["model"] == "sir" and back.attrs["fit_sha256"]
    assert back.attrs["model_sha256"] and back.attrs["version_jax"] == jax.__version__
    fig = plot_profile(path, tmp_path / "profile.png")
    assert (tmp_path / "profile.png").read_bytes()[:4] == b"\x89PNG"
    ax = fig.axes[0]
    assert any(np.allclose(ln.get_ydata(), prof.cut) for ln in ax.get_lines())
    labels = ax.get_legend_handles_labels()[1]
    assert "95% Laplace interval" in labels and "95% profile interval" in labels


@pytest.mark.parametrize(
    ("parameter", "kw", "message"),
    [
        (
            "delta",
            {},
            r"parameter: unknown parameter 'delta'; the free parameters "
            r"are I0, beta, gamma$",
        ),
        ("N", {}, r"parameter: 'N' is fixed in this fit"),
        ("R0", {}, r"parameter: 'R0' is a derived quantity"),
        ("gamma", {"points": 2}, r"points: must be between 3 and 1001; got 2"),
        ("gamma", {"points": 2.5}, r"points: must be an integer; got float 2.5"),
        ("gamma", {"span": 0.0}, r"span: must be a finite number > 0"),
        ("gamma", {"level": 1.0}, r"level: must be in \(0, 1\)"),
    ],
)
def test_bad_arguments_are_located(fitted, parameter, kw, message):
    _, path = fitted
    with pytest.raises(ProfileError, match=message) as e:
        profile(path, parameter, **kw)
    assert str(e.value).startswith(f"{path}: ") and "\n" not in str(e.value)


def test_an_entry_transform_is_float64_in_a_float32_session(fitted):
    """The profile maps its grid to the parameter's scale in float64 when the
    session computes in float32, and silently (it asked JAX for float64
    arrays without x64: a truncation warning, and float32 values)."""
    objective = profile_objective(fitted[0])
    c = _entry_transform(objective, objective.free.labels.index("gamma"))
    u = np.array([-3.0, 0.1, 2.0 + 1e-12])
    with jax.enable_x64(False), warnings.catch_warnings():
        warnings.simplefilter("error")
        out = c(u)
    assert out.dtype == np.float64
    np.testing.assert_allclose(out, _softplus(u), rtol=1e-15)
    assert out[2] != c(np.array([2.0]))[0]  # beyond float32's resolution


def test_crossings_interpolate_the_signed_root():
    # an exactly quadratic profile: the signed root is linear, so the
    # interpolation is exact; a flat side has no crossing
    x = np.linspace(-3.0, 3.0, 7)
    lo, hi, notes = crossings(x, 0.5 * x**2, CUT, 3)
    assert lo == pytest.approx(-math.sqrt(2 * CUT)) and hi == -lo and not notes
    flat = np.where(x < 0, 0.0, 0.5 * x**2)
    lo, hi, _ = crossings(x, flat, CUT, 3)
    assert math.isnan(lo) and hi == pytest.approx(math.sqrt(2 * CUT))
    wavy = np.array([9.0, 1.0, 3.0, 0.0, 3.0, 1.0, 9.0])
    lo, hi, notes = crossings(x, wavy, CUT, 3)
    assert len(notes) == 2 and "not one interval" in notes[0]


FLAT_MODEL = """
name = "sir_product"
compartments = ["S", "I", "R"]

[parameters]
N = { value = 763.0, fixed = true }
a = { value = 1.0, transform = "softplus" }
b = { value = 2.0, transform = "softplus" }
gamma = { value = 0.5, transform = "softplus" }
I0 = { value = 1.0, transform = "softplus" }

[[infections]]
from = "S"
to = "I"
transmission = "a * b"
infectious = ["I"]
normalize = "population"
population = "N"

[[transitions]]
from = "I"
to = "R"
rate = "gamma"

[initial]
S = "N - I0"
I = "I0"

[[observations]]
name = "in_bed"
kind = "prevalence"
compartments = ["I"]
family = "least_squares"
"""


@pytest.mark.slow
def test_a_flat_profile_is_not_identifiable(fitted, tmp_path, capsys):
    """Transmission `a * b`: only the product is identified, so the profile
    of `a` is flat (`b` compensates at every point) on both sides; the
    command says so and the file records it."""
    model = tmp_path / "product.toml"
    model.write_text(FLAT_MODEL)
    phases = [{"method": "levenberg_marquardt", "iterations": 100}]
    fit = calibrate(model, DATA, fit={"rtol": 1e-8, "phases": phases}, progress=False)
    assert not math.isfinite(fit.intervals["a"]["se"])  # the Laplace is singular
    fit.to_netcdf(tmp_path / "FIT.nc")
    argv = ["profile", str(tmp_path / "FIT.nc"), "--parameter", "a", "--points", "5"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "95% likelihood-ratio interval [not identifiable, not identifiable]" in text
    assert "note: not identifiable on the lower side: the profile rises by only" in text
    assert "note: not identifiable on the upper side" in text
    assert "grid spans ± 3 on the transformed scale" in text
    prof = Profile.from_netcdf(tmp_path / "FIT.profile-a.nc")
    assert prof.identifiable == (False, False) and not prof.identified
    assert math.isnan(prof.lower) and math.isnan(prof.upper)
    assert np.all(prof.delta < 1e-6)
    # b compensates: the product stays the transmission rate of the SIR fit
    a = prof.estimates[:, prof.estimate_labels.index("a")]
    b = prof.estimates[:, prof.estimate_labels.index("b")]
    beta = fitted[0].intervals["beta"]["estimate"]
    np.testing.assert_allclose(a * b, beta, rtol=1e-5)


@pytest.mark.slow
def test_the_profile_includes_the_fits_prior():
    """A normal prior on beta: the profiled function is the fit's own loss
    (the sum of squares plus the prior's `((beta - mean) / sd)² / 2`, over
    `2 s²`), recomputed here with SciPy at every re-optimised point, and its
    minimum is the fit."""
    prior = {"family": "normal", "mean": 1.5, "sd": 0.05}
    config = {
        "rtol": 1e-8,
        "atol": 1e-8,
        "parameters": {"beta": {"prior": prior}},
        "phases": [{"method": "levenberg_marquardt", "iterations": 100}],
    }
    fit = calibrate(MODEL, DATA, fit=config, progress=False)
    prof = profile(fit, "gamma", points=5)
    s2 = fit.uncertainty["noise_variance"]
    assert prof.value[2] == pytest.approx(fit.loss / (2.0 * s2), rel=1e-12)
    assert prof.minimum == prof.value[2] and prof.delta[2] == 0.0
    est = {k: prof.estimates[:, i] for i, k in enumerate(prof.estimate_labels)}
    for k in range(5):
        ssr = _ssr(est["beta"][k], est["gamma"][k], est["I0"][k])
        nll_prior = 0.5 * ((est["beta"][k] - 1.5) / 0.05) ** 2
        # solver tolerance 1e-8 against SciPy's 1e-11
        assert prof.value[k] == pytest.approx((ssr + nll_prior) / (2 * s2), rel=1e-7)
    assert any("divided by 2 s²" in n for n in prof.notes)

    # the Laplace approximation reads the same objective: the precision is
    # (2 JᵀJ + 2 J_pᵀJ_p) / (2 s²), J by central differences of SciPy's
    # residuals on the softplus scale, J_p that of the prior's residual
    z0 = np.array([_softplus_inverse(fit.intervals[k]["estimate"]) for k in fit.labels])

    def residuals(z):
        c = dict(zip(fit.labels, _softplus(z), strict=True))
        return _residuals(c["beta"], c["gamma"], c["I0"])

    h = 1e-5
    J = np.stack(
        [(residuals(z0 + h * e) - residuals(z0 - h * e)) / (2 * h) for e in np.eye(3)],
        axis=1,
    )
    i = fit.labels.index("beta")
    Jp = np.zeros(3)
    # the prior's residual ((beta - mean) / sd) / sqrt(2), d beta / dz = sigmoid(z)
    Jp[i] = 1.0 / (0.05 * math.sqrt(2.0)) / (1.0 + math.exp(-z0[i]))
    precision = (2.0 * J.T @ J + 2.0 * np.outer(Jp, Jp)) / (2.0 * s2)
    np.testing.assert_allclose(fit.covariance, np.linalg.inv(precision), rtol=1e-5)


# -- the command ---------------------------------------------------------------------
@pytest.fixture
def _no_persistent_cache(monkeypatch):
    """`main` would enable JAX's persistent compilation cache for the session."""
    monkeypatch.setenv("EPIFIT_NO_CACHE", "1")


@pytest.mark.usefixtures("_no_persistent_cache")
def test_cli_writes_the_profile_and_refuses_the_fit_file(fitted, tmp_path, capsys):
    _, fit_path = fitted
    fit_nc = tmp_path / "FIT.nc"
    fit_nc.write_bytes(fit_path.read_bytes())
    before = fit_nc.read_bytes()
    out, fig = tmp_path / "PROFILE.nc", tmp_path / "profile.png"
    argv = ["profile", str(fit_nc), "--parameter", "gamma", "--points", "5"]
    assert main([*argv, "--out", str(out), "--plot", str(fig), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["out"] == str(out) and summary["plot"] == str(fig)
    assert summary["identifiable"] == {"lower": True, "upper": True}
    prof = Profile.from_netcdf(out)
    assert summary["lower"] == prof.lower and summary["points"] == 5
    assert prof.attrs["command"].startswith("epifit profile")
    assert prof.attrs["fit_sha256"] == hashlib.sha256(before).hexdigest()
    assert fig.read_bytes()[:4] == b"\x89PNG"

    # never over the input
    assert main([*argv, "--out", str(fit_nc)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("epifit: error: --out ") and "same file as" in err
    assert "\n" not in err and fit_nc.read_bytes() == before

    # atomic: a write failing half-way leaves the previous PROFILE.nc
    written = out.read_bytes()

    def half(self, path, *args, **kwargs):
        Path(path).write_bytes(b"CDF partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(xr.Dataset, "to_netcdf", half)
        assert main([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "no space left on device" in err
    assert out.read_bytes() == written
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["FIT.nc", "PROFILE.nc", "profile.png"]
    )


@pytest.mark.usefixtures("_no_persistent_cache")
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--parameter", "delta"], r"FIT\.nc: --parameter: unknown parameter 'delta'"),
        (["--parameter", "N"], r"FIT\.nc: --parameter: 'N' is fixed in this fit"),
        (["--parameter", "gamma", "--points", "0"], r"--points must be >= 1; got 0"),
        (["--parameter", "gamma", "--points", "x"], r"--points must be an integer"),
        (
            ["--parameter", "gamma", "--points", "2000"],
            r"FIT\.nc: --points: must be between 3 and 1001; got 2000",
        ),
        (["--parameter", "gamma", "--span", "-1"], r"--span must be > 0; got -1"),
        ([], r"the following arguments are required: --parameter"),
    ],
)
def test_cli_bad_flags_are_one_line(fitted, tmp_path, capsys, extra, message):
    _, fit_path = fitted
    try:
        code = main(["profile", str(fit_path), *extra, "--out", str(tmp_path / "p.nc")])
    except SystemExit as e:  # argparse's own usage errors
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("epifit: error: ") and "\n" not in err
    assert re.search(message, err), err
    assert list(tmp_path.iterdir()) == []
