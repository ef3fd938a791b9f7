"""Experiment trackers beside metrics.jsonl: Weights & Biases and MLflow (`run.loggers`).

Each receives, per step, the flat dict `MetricsLogger.log` wrote to metrics.jsonl (rank 0 only; the
trainer builds them there). Both are optional packages (extras `wandb`, `mlflow`), imported when a tracker
is built; a missing one is a ConfigError of one line naming the extra.

    wandb   a W&B run whose id is the run's id (run.json), named after the output directory, its files in
            output_dir/wandb; `resume="allow"`, so a resumed run continues the same W&B run. W&B's own
            settings apply: WANDB_MODE=offline writes the run only to disk (`wandb sync` uploads it later),
            WANDB_PROJECT names the project (default "megatron-gptoss"), WANDB_ENTITY the team.
    mlflow  an MLflow run tagged `megatron_gptoss.run_id` with the run's id (a resumed run finds it and
            continues it), named after the output directory, in experiment MLFLOW_EXPERIMENT_NAME (default
            "megatron-gptoss"). The store is MLFLOW_TRACKING_URI when set, else a local SQLite file,
            output_dir/mlflow.db (`mlflow ui --backend-store-uri sqlite:///<output_dir>/mlflow.db`). The
            config becomes the run's parameters when the run is created. MLflow takes metric names of
            letters, digits and `_-. /:`; any other character is sent as "_" (`mlflow_metric_name`).

Neither can delete what it received: steps that run again after resuming from a checkpoint older than the
last logged step are sent a second time (metrics.jsonl and TensorBoard keep only the new values). A tracker
that raises while logging is reported once and dropped; metrics.jsonl keeps every step.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from megatron_gptoss.config.loggers import EXTRAS, missing_package_message
from megatron_gptoss.errors import ConfigError
from megatron_gptoss.utils.metrics import run_name

log = logging.getLogger(__name__)

PROJECT = "megatron-gptoss"  # the default W&B project and MLflow experiment
MLFLOW_DB = "mlflow.db"
MLFLOW_ARTIFACTS = "mlartifacts"
RUN_ID_TAG = "megatron_gptoss.run_id"
_MLFLOW_BAD_CHARACTER = re.compile(r"[^\w.\- :/]")


class Tracker(Protocol):
    """Receives the flat metrics of each step; `close(failed)` ends its run (failed: the run raised)."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self, failed: bool = False) -> None: ...


def import_extra(logger: str, module: str) -> ModuleType:
    """`import module` for tracker `logger` (a key of config.loggers.EXTRAS); ConfigError of one line naming
    the extra when it is not installed, or the import's error when it is installed but fails to import."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        if importlib.util.find_spec(module) is None:
            raise ConfigError(missing_package_message(logger, module)) from err
        raise ConfigError(f"run.loggers lists {logger!r}, but importing {module!r} failed: {err}") from err


def open_trackers(
    names: list[str], output_dir: str | os.PathLike, run_id: str, config: Mapping[str, Any]
) -> list[Tracker]:
    """The trackers among `names` (run.loggers; "jsonl" and "tensorboard" are MetricsLogger's own) for
    the run `run_id` writing to `output_dir`, with `config` (the run's config as a nested dict)."""
    trackers: list[Tracker] = []
    try:
        for name in names:
            if name == "wandb":
                trackers.append(WandbTracker(output_dir, run_id, config))
            elif name == "mlflow":
                trackers.append(MlflowTracker(output_dir, run_id, config))
    except BaseException:
        for tracker in trackers:
            tracker.close(failed=True)
        raise
    return trackers


class WandbTracker:
    """A W&B run (module docstring)."""

    def __init__(self, output_dir: str | os.PathLike, run_id: str, config: Mapping[str, Any]):
        for module in EXTRAS["wandb"][1]:
            import_extra("wandb", module)
        import wandb

        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", PROJECT),
            id=run_id,
            name=run_name(output_dir),
            dir=str(output_dir),
            config=dict(config),
            resume="allow",
            reinit="create_new",
        )

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class MlflowTracker:
    """An MLflow run (module docstring)."""

    def __init__(self, output_dir: str | os.PathLike, run_id: str, config: Mapping[str, Any]):
        for module in EXTRAS["mlflow"][1]:
            import_extra("mlflow", module)
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._metric = Metric
        out = Path(output_dir).resolve()
        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{out / MLFLOW_DB}"
        self.tracking_uri = uri
        self.client = MlflowClient(uri)
        experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT)
        experiment = self.client.get_experiment_by_name(experiment_name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:  # the local store keeps its artifacts beside it, not in the working directory
            local = "MLFLOW_TRACKING_URI" not in os.environ
            location = (out / MLFLOW_ARTIFACTS).as_uri() if local else None
            experiment_id = self.client.create_experiment(experiment_name, artifact_location=location)
        found = self.client.search_runs(
            [experiment_id], filter_string=f"tags.`{RUN_ID_TAG}` = '{run_id}'", max_results=1
        )
        if found:
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            run = self.client.create_run(
                experiment_id, run_name=run_name(output_dir), tags={RUN_ID_TAG: run_id}
            )
            self.run_id = run.info.run_id
            params = [Param(key, str(value)[:6000]) for key, value in _flatten(config).items()]
            for start in range(0, len(params), 100):  # MLflow takes at most 100 parameters a call
                self.client.log_batch(self.run_id, params=params[start : start + 100])

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        stamp = int(time.time() * 1000)
        batch = [self._metric(mlflow_metric_name(k), float(v), stamp, step) for k, v in metrics.items()]
        for start in range(0, len(batch), 1000):  # MLflow takes at most 1000 metrics a call
            self.client.log_batch(self.run_id, metrics=batch[start : start + 1000])

    def close(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


def mlflow_metric_name(name: str) -> str:
    """`name` as MLflow stores it: characters outside letters, digits and `_-. /:` become "_"."""
    return _MLFLOW_BAD_CHARACTER.sub("_", name)


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"run": {"steps": 3}} -> {"run.steps": 3}."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
