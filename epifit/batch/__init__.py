"""Batches of independent fits and forecasts on Dask distributed (see
README.md and `docs/batch.md`): a `BATCH.toml` declares tasks as a product of
axes (models, datasets or their patches, fit configurations, seeds, bootstrap
replicates, scenario files); [`run_batch`][] runs them on an embedded
`LocalCluster` or an existing Dask cluster and merges the task files into one
`batch.nc` with a `task` dimension (and a `scenario` one for forecasts)."""

from epifit.batch._bootstrap import bootstrap_data as bootstrap_data
from epifit.batch._bootstrap import bootstrap_intervals as bootstrap_intervals
from epifit.batch._bootstrap import replicate_seed as replicate_seed
from epifit.batch._engine import RETRIES as RETRIES
from epifit.batch._engine import open_client as open_client
from epifit.batch._engine import worker_env as worker_env
from epifit.batch._run import BatchResult as BatchResult
from epifit.batch._run import run_batch as run_batch
from epifit.batch._spec import BatchError as BatchError
from epifit.batch._spec import BatchSpec as BatchSpec
from epifit.batch._spec import Bootstrap as Bootstrap
from epifit.batch._spec import Task as Task
from epifit.batch._spec import load_batch as load_batch
from epifit.batch._spec import parse_batch as parse_batch
from epifit.batch._task import TaskInput as TaskInput
from epifit.batch._task import run_task as run_task
