"""Scenario forecasting: scenarios x parameter samples of a fitted model.

Scenarios are data (a `SCENARIOS.toml` file, a mapping, or [`Scenario`][]
objects) whose changes are [`CovariateChange`][]s, [`ParameterChange`][]s and
[`TransmissionChange`][]s, the final kinds of [`AbstractChange`][]
([`Change`][] picks one by its target); [`forecast`][] runs each of them for
samples of the fit's Laplace approximation through one compiled, vmapped solve
and summarises the ensemble to quantiles, peaks and cumulative totals, as an
xarray Dataset (`epifit_kind = "forecast"`); [`plot_forecast`][] draws its fan
charts.
"""

from epifit.forecasting._bind import BoundScenarios as BoundScenarios
from epifit.forecasting._bind import bind_scenarios as bind_scenarios
from epifit.forecasting._change import AbstractChange as AbstractChange
from epifit.forecasting._change import ParameterChange as ParameterChange
from epifit.forecasting._change import TransmissionChange as TransmissionChange
from epifit.forecasting._covariate import CovariateChange as CovariateChange
from epifit.forecasting._ensemble import EnsembleConfig as EnsembleConfig
from epifit.forecasting._ensemble import default_chunk as default_chunk
from epifit.forecasting._ensemble import draw_samples as draw_samples
from epifit.forecasting._ensemble import iter_ensemble as iter_ensemble
from epifit.forecasting._ensemble import param_template as param_template
from epifit.forecasting._ensemble import run_ensemble as run_ensemble
from epifit.forecasting._error import ScenarioError as ScenarioError
from epifit.forecasting._forecast import DEFAULT_QUANTILES as DEFAULT_QUANTILES
from epifit.forecasting._forecast import PreparedForecast as PreparedForecast
from epifit.forecasting._forecast import forecast as forecast
from epifit.forecasting._forecast import forecast_summary as forecast_summary
from epifit.forecasting._forecast import prepare_forecast as prepare_forecast
from epifit.forecasting._horizon import Horizon as Horizon
from epifit.forecasting._horizon import carry_forward as carry_forward
from epifit.forecasting._plot import plot_forecast as plot_forecast
from epifit.forecasting._scenario import BASELINE as BASELINE
from epifit.forecasting._scenario import Change as Change
from epifit.forecasting._scenario import Scenario as Scenario
from epifit.forecasting._scenario import ScenarioSet as ScenarioSet
from epifit.forecasting._scenario import load_scenarios as load_scenarios
from epifit.forecasting._scenario import parse_scenarios as parse_scenarios
from epifit.forecasting._settings import solver_settings as solver_settings
