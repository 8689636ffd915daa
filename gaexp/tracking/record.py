"""One flat MLflow run per cell, recorded: a run that always ends (FINISHED, FAILED or KILLED, its error tagged), its
config as params, each evaluation as metrics and as the curves tags the report reads, its summary and artifacts.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import tempfile
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from mlflow.entities import Metric, Param, Run, RunStatus, RunTag
from mlflow.tracking import MlflowClient

from gaexp import liveness, metrics
from gaexp.hooks import EvalPoint, Hook, Stopped
from gaexp.redact import mask
from gaexp.tags import (CURVES, ERROR, ERROR_TRACEBACK, HEARTBEAT, HOST, PROCESS_START, SLURM_JOB, STOPPED_REASON,
                        STOPPED_STEP)


log = logging.getLogger("gaexp.app")  # the application's log


MAX_PARAM_LENGTH = 6000  # MLflow's limit on a param value


MAX_TAG_LENGTH = 8000  # and on a tag value


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


def curves_tags(history: Sequence[EvalPoint]) -> list[RunTag]:
    """The run's evaluations (step, headline, train_loss: valid_acc for images) as tags, so one search returns a sweep's curves
    whole: JSON in parts of at most MLflow's 8,000 characters a tag value (`CURVES`.<i>), and `CURVES`
    saying how many. The same floats the histories hold (JSON writes a float's shortest exact form)."""
    text = json.dumps([[p.step, p.value, p.train_loss] for p in history], separators=(",", ":"))
    parts = [text[i:i + MAX_TAG_LENGTH] for i in range(0, len(text), MAX_TAG_LENGTH)]
    return [RunTag(CURVES, str(len(parts))), *(RunTag(f"{CURVES}.{i}", part) for i, part in enumerate(parts))]


def curves_of(run: Run) -> list[tuple[int, float, float]] | None:
    """The evaluations `curves_tags` recorded in the run, or None if it recorded none (a run logged before
    gaexp wrote them, or one that did not finish): then its metric histories are read."""
    tags = run.data.tags
    if not tags.get(CURVES, "").isdigit():
        return None
    parts = [tags.get(f"{CURVES}.{i}") for i in range(int(tags[CURVES]))]
    if any(part is None for part in parts):
        return None
    return [(int(step), float(acc), float(loss)) for step, acc, loss in json.loads("".join(parts))]


@contextmanager
def tracked_run(client: MlflowClient, experiment_id: str, run_name: str,
                tags: Mapping[str, Any]) -> Iterator[str]:
    """A run that always ends: FINISHED, KILLED on Ctrl-C or when stopped on purpose (hooks.Stopped, with
    the step as a tag), FAILED with the error as tags."""
    tags = {**tags, HOST: f"{socket.gethostname()}:{os.getpid()}", HEARTBEAT: f"{time.time():.0f}"}
    if started := liveness.process_start(os.getpid()):
        tags[PROCESS_START] = started
    if job := liveness.slurm_job():
        tags[SLURM_JOB] = job
    run_id = client.create_run(experiment_id, run_name=run_name,
                               tags={k: mask(str(v)) for k, v in tags.items()}).info.run_id
    try:
        yield run_id
    except KeyboardInterrupt:
        client.set_terminated(run_id, RunStatus.to_string(RunStatus.KILLED))
        raise
    except Stopped as e:  # on purpose (pruned): KILLED, with the step and why, never FAILED
        client.set_tag(run_id, STOPPED_STEP, str(e.step))
        client.set_tag(run_id, STOPPED_REASON, e.reason)
        client.set_terminated(run_id, RunStatus.to_string(RunStatus.KILLED))
        raise
    except BaseException as e:
        client.set_tag(run_id, ERROR, mask(f"{type(e).__name__}: {e}")[:5000])  # a driver's error may name its URL
        client.set_tag(run_id, ERROR_TRACEBACK, mask(traceback.format_exc())[-5000:])
        client.set_terminated(run_id, RunStatus.to_string(RunStatus.FAILED))
        raise
    client.set_terminated(run_id, RunStatus.to_string(RunStatus.FINISHED))


def log_masked_artifacts(client: MlflowClient, run_id: str, folder: Path, artifact_path: str | None = None) -> None:
    """`folder`'s files as the run's artifacts, each text file with its credentials masked (redact.mask):
    Hydra's config.yaml, hydra.yaml and overrides.yaml hold the config as given."""
    with tempfile.TemporaryDirectory() as tmp:
        for path in folder.rglob("*"):
            if not path.is_file():
                continue
            target = Path(tmp, path.relative_to(folder))
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                target.write_text(mask(path.read_text()))
            except UnicodeDecodeError:
                target.write_bytes(path.read_bytes())
        client.log_artifacts(run_id, tmp, artifact_path)


def log_params(client: MlflowClient, run_id: str, config: Mapping[str, Any]) -> None:
    params = [Param(k, mask(str(v))[:MAX_PARAM_LENGTH]) for k, v in sorted(flatten(config).items())]
    for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
        client.log_batch(run_id, params=params[i:i + 100])


def log_shared(client: MlflowClient, run_id: str, source: Run, extra: Mapping[str, float] | None = None) -> None:
    """In `run_id`, what `source` computed for it (SAME_AS): every metric history and result, at their steps, and
    its curves; none of what it measured of its machine or its micro-batch (RESOURCES: times, memory), of which the
    shared run logs `extra` alone (its own micro-batch's activations)."""
    now = int(time.time() * 1000)
    logged = [Metric(name, m.value, now, m.step) for name in sorted(source.data.metrics) if name not in metrics.RESOURCES
              for m in client.get_metric_history(source.info.run_id, name)]
    last = max((m.step for m in logged), default=0)
    logged += [Metric(name, value, now, last) for name, value in (extra or {}).items()]
    curves = [RunTag(name, value) for name, value in source.data.tags.items() if name == CURVES or name.startswith(f"{CURVES}.")]
    for i in range(0, max(len(logged), 1), 1000):  # MLflow takes at most 1,000 metrics per batch
        client.log_batch(run_id, metrics=logged[i:i + 1000], tags=curves if i == 0 else [])


def log_eval_point(client: MlflowClient, run_id: str, point: EvalPoint) -> None:
    """One batch per evaluation: the metric histories, with step = optimizer step, and the heartbeat."""
    now = int(time.time() * 1000)
    values = {**point.valid, metrics.TRAIN_LOSS.name: point.train_loss,
              **({metrics.LOSS_SCALE.name: point.loss_scale} if point.loss_scale is not None else {})}
    client.log_batch(run_id, metrics=[Metric(name, value, now, point.step) for name, value in values.items()],
                     tags=[RunTag(HEARTBEAT, f"{now / 1000:.0f}")])


class MlflowLogger(Hook):
    """Every evaluation into the run, as it happens (so a crash keeps the history so far)."""

    def __init__(self, client: MlflowClient, run_id: str) -> None:
        self.client, self.run_id = client, run_id

    def after_eval(self, point: EvalPoint) -> None:
        log_eval_point(self.client, self.run_id, point)


def log_summary(client: MlflowClient, run_id: str, history: list[EvalPoint], wall_seconds: float,
                extra: Mapping[str, float] | None = None) -> None:
    """Run-level metrics at the last step: the headline's final and best value (final_valid_acc and
    best_valid_acc for images, the highest; final_valid_loss and best_valid_loss for a language model, the lowest),
    speed, and any `extra` (e.g. memory); and the run's curves as tags (`curves_tags`)."""
    now, last = int(time.time() * 1000), history[-1]
    best = max if metrics.headline_named(last.headline).higher_is_better else min
    values = {
        f"final_{last.headline}": last.value,
        f"best_{last.headline}": best(p.value for p in history),
        metrics.WALL_SECONDS.name: wall_seconds,
        metrics.SAMPLES_PER_SEC.name: last.samples_per_sec,
        **last.speed,
        **({metrics.SKIPPED_STEPS.name: last.skipped_steps} if last.skipped_steps is not None else {}),
        **(extra or {}),
    }
    client.log_batch(run_id, metrics=[Metric(k, v, now, last.step) for k, v in values.items()],
                     tags=curves_tags(history))
