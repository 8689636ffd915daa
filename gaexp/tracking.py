"""MLflow: prepare the store once, then one flat run per grid cell.

Everything goes through an explicit `MlflowClient(tracking_uri)`: no
process-wide tracking URI or active-run stack.
"""

from __future__ import annotations

import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping

from mlflow.entities import Metric, Param, RunStatus
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from gaexp.train import EvalPoint

MAX_PARAM_LENGTH = 6000  # MLflow's limit on a param value


def is_remote(tracking_uri: str) -> bool:
    return tracking_uri.startswith(("http://", "https://", "databricks"))


def prepare_store(tracking_uri: str, experiment_name: str, artifact_location: str | None) -> str:
    """Create the store and the experiment if needed; return the experiment id.

    Call once before parallel jobs start: several processes creating a fresh
    SQLite store at once break it. Local stores get the explicit, absolute
    artifact location; a server chooses its own.
    """
    if tracking_uri.startswith("sqlite:///"):
        Path(tracking_uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    client = MlflowClient(tracking_uri)
    experiment = client.get_experiment_by_name(experiment_name)
    if experiment is None:
        location = None if is_remote(tracking_uri) or not artifact_location else Path(artifact_location).resolve().as_uri()
        try:
            return client.create_experiment(experiment_name, artifact_location=location)
        except MlflowException:  # created meanwhile by another process
            experiment = client.get_experiment_by_name(experiment_name)
            if experiment is None:
                raise
    if experiment.lifecycle_stage != "active":
        raise ValueError(f"MLflow experiment {experiment_name!r} in {tracking_uri} is deleted; "
                         "restore it (mlflow experiments restore) or choose another mlflow.experiment_name")
    return experiment.experiment_id


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'train': {'lr': 0.001}} -> {'train.lr': 0.001}."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


@contextmanager
def tracked_run(client: MlflowClient, experiment_id: str, run_name: str,
                tags: Mapping[str, Any]) -> Iterator[str]:
    """A run that always ends: FINISHED, KILLED on Ctrl-C, FAILED with the error as tags."""
    run_id = client.create_run(experiment_id, run_name=run_name,
                               tags={k: str(v) for k, v in tags.items()}).info.run_id
    try:
        yield run_id
    except KeyboardInterrupt:
        client.set_terminated(run_id, RunStatus.to_string(RunStatus.KILLED))
        raise
    except BaseException as e:
        client.set_tag(run_id, "error", f"{type(e).__name__}: {e}"[:5000])
        client.set_tag(run_id, "error.traceback", traceback.format_exc()[-5000:])
        client.set_terminated(run_id, RunStatus.to_string(RunStatus.FAILED))
        raise
    client.set_terminated(run_id, RunStatus.to_string(RunStatus.FINISHED))


def log_params(client: MlflowClient, run_id: str, config: Mapping[str, Any]) -> None:
    params = [Param(k, str(v)[:MAX_PARAM_LENGTH]) for k, v in sorted(flatten(config).items())]
    for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
        client.log_batch(run_id, params=params[i:i + 100])


def log_eval_point(client: MlflowClient, run_id: str, point: EvalPoint) -> None:
    """One batch per evaluation: the metric histories, with step = optimizer step."""
    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[
        Metric("valid_acc", point.valid_acc, now, point.step),
        Metric("train_loss", point.train_loss, now, point.step),
    ])


def log_summary(client: MlflowClient, run_id: str, history: list[EvalPoint], wall_seconds: float,
                extra: Mapping[str, float] | None = None) -> None:
    """Run-level metrics at the last step: accuracy, speed, and any `extra` (e.g. memory)."""
    now, last = int(time.time() * 1000), history[-1]
    values = {
        "final_valid_acc": last.valid_acc,
        "best_valid_acc": max(p.valid_acc for p in history),
        "wall_seconds": wall_seconds,
        "samples_per_sec": last.samples_per_sec,
        **(extra or {}),
    }
    client.log_batch(run_id, metrics=[Metric(k, v, now, last.step) for k, v in values.items()])
