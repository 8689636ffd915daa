"""MLflow: prepare the store once, then one flat run per grid cell.

Everything goes through an explicit `MlflowClient(tracking_uri)`: no
process-wide tracking URI or active-run stack.
Whether a run's process or SLURM job still runs is asked of gaexp/liveness.py.
"""

from __future__ import annotations

import base64
import gc
import hashlib
import json
import logging
import os
import socket
import sqlite3
import tempfile
import time
import traceback
import urllib.error
import urllib.parse
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Sequence

from mlflow.entities import Metric, Param, Run, RunStatus, RunTag, ViewType
from mlflow.entities import Dataset, DatasetInput, InputTag, LoggedModelOutput, LoggedModelStatus
from mlflow.exceptions import MlflowException
from mlflow.models import Model
from mlflow.tracking import MlflowClient

from gaexp import liveness, metrics
from gaexp.config import HOLDOUT_SEED, protocol_part
from gaexp.hooks import EvalPoint, Hook, Stopped
from gaexp.redact import mask
from gaexp.tags import (CURVES, ERROR, ERROR_TRACEBACK, EXPERIMENT_KIND, HEARTBEAT, HOST, KILLED_REASON, PROCESS_START,
                        PROTOCOL_KEY, SLURM_JOB, STOPPED_REASON, STOPPED_STEP, SWEEP_ID, SWEEPS, filter_equals, in_sweep)

if TYPE_CHECKING:  # torch and MLflow's flavour load only where a model is logged or loaded (gaexp-status stays light)
    import torch

log = logging.getLogger("gaexp.app")  # the application's log

MAX_PARAM_LENGTH = 6000  # MLflow's limit on a param value
MAX_TAG_LENGTH = 8000  # and on a tag value
PAGE_SIZE = 1_000  # runs per search page (search_all follows the pages to the end)


def is_remote(tracking_uri: str) -> bool:
    return tracking_uri.startswith(("http://", "https://", "databricks"))


def check_server(tracking_uri: str, timeout: float = 5.0) -> None:
    """Fail fast, naming the URI (its password masked), on a tracking server that does not answer (the schema
    checked the scheme). A user and password in the URI are sent as basic auth, as the MLflow client sends them,
    and so are MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD; urllib would take `user:pass@host` for
    the host's name."""
    if tracking_uri.startswith(("http://", "https://")):
        url, credentials = without_userinfo(tracking_uri)
        request = urllib.request.Request(f"{url.rstrip('/')}/health")
        if credentials is None and os.environ.get("MLFLOW_TRACKING_USERNAME"):
            credentials = (os.environ["MLFLOW_TRACKING_USERNAME"], os.environ.get("MLFLOW_TRACKING_PASSWORD", ""))
        if credentials is not None:
            token = base64.b64encode(":".join(credentials).encode()).decode()
            request.add_header("Authorization", f"Basic {token}")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                response.read()
        except (urllib.error.URLError, OSError, ValueError) as e:
            reason = getattr(e, "reason", e)
            raise ConnectionError(mask(f"MLflow tracking server {tracking_uri} unreachable: {reason}")) from None


def without_userinfo(url: str) -> tuple[str, tuple[str, str] | None]:
    """An HTTP(S) URL without its `user:password@` (the userinfo up to the last `@` of the authority, as
    urllib and requests take it), and the user and password, percent-decoded; None without a userinfo."""
    parts = urllib.parse.urlsplit(url)
    userinfo, at, host = parts.netloc.rpartition("@")
    if not at:
        return url, None
    user, _, password = userinfo.partition(":")
    bare = urllib.parse.urlunsplit(parts._replace(netloc=host))
    return bare, (urllib.parse.unquote(user), urllib.parse.unquote(password))


def prepare_store(tracking_uri: str, experiment_name: str, artifact_location: str | None) -> str:
    """Create the store and the experiment if needed; return the experiment id.

    Call once before parallel jobs start: several processes creating a fresh
    SQLite store at once break it. Local stores get the explicit, absolute
    artifact location; a server chooses its own.
    """
    if tracking_uri.startswith("sqlite:///"):
        Path(tracking_uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    client = MlflowClient(tracking_uri)
    experiment = client.get_experiment_by_name(experiment_name)  # a fresh store: its tables made here
    if tracking_uri.startswith("sqlite:///"):
        index_tags(Path(tracking_uri.removeprefix("sqlite:///")))
    if experiment is None:
        location = None if is_remote(tracking_uri) or not artifact_location else Path(artifact_location).resolve().as_uri()
        try:
            return client.create_experiment(experiment_name, artifact_location=location, tags=dict([EXPERIMENT_KIND]))
        except MlflowException:  # created meanwhile by another process
            experiment = client.get_experiment_by_name(experiment_name)
            if experiment is None:
                raise
    if experiment.lifecycle_stage != "active":
        raise ValueError(f"MLflow experiment {experiment_name!r} in {tracking_uri} is deleted; "
                         "restore it (mlflow experiments restore) or choose another mlflow.experiment_name")
    if experiment.tags.get(EXPERIMENT_KIND[0]) != EXPERIMENT_KIND[1]:  # also stores made before the tag
        client.set_experiment_tag(experiment.experiment_id, *EXPERIMENT_KIND)
    return experiment.experiment_id


TAGS_INDEX = "CREATE INDEX IF NOT EXISTS gaexp_tags_key_value ON tags (key, value, run_uuid)"


def index_tags(db: Path) -> None:
    """The index that lets a SQLite store find runs by a tag's value (a sweep's runs, a cell's finished run
    of the same protocol) without reading every run's tags: MLflow indexes tags by key and run only, so
    each such search read one tag of every run (0.2 s a search at 100,000 runs, 3 ms with it). Made once
    (seconds on a large store); MLflow ignores it. A server on another database: docs/cluster.md."""
    con = sqlite3.connect(db, timeout=60)
    try:
        con.execute(TAGS_INDEX)
        con.commit()
    finally:
        con.close()


def experiment_id(client: MlflowClient, experiment_name: str) -> str:
    """The id of an experiment `prepare_store` created (a job runs after its sweep prepared the store)."""
    experiment = client.get_experiment_by_name(experiment_name)
    if experiment is None or experiment.lifecycle_stage != "active":
        raise ValueError(f"no active MLflow experiment {experiment_name!r} in {client.tracking_uri}; "
                         "run through `gaexp`, whose first step creates it")
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


def protocol_key(resolved: Mapping[str, Any]) -> str:
    """A stable digest of everything that can change a run's result: the config without its runtime keys."""
    kept = protocol_part(resolved)
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]


def search_all(client: MlflowClient, experiment_ids: list[str], filter_string: str = "",
               order_by: list[str] | None = None, run_view_type: int = ViewType.ACTIVE_ONLY) -> list[Run]:
    """Every run the search matches: MLflow returns a page at a time (`PAGE_SIZE` runs); this follows its
    page tokens to the end, so no store is too large to be read whole. A run that moved between pages while
    they were read (a run started meanwhile shifts the order) is kept once."""
    runs: dict[str, Run] = {}
    token = None
    with bulk_read():
        while True:
            page = client.search_runs(experiment_ids, filter_string, run_view_type, PAGE_SIZE, order_by, token)
            runs.update((r.info.run_id, r) for r in page)
            token = page.token
            if not token:
                return list(runs.values())


@contextmanager
def bulk_read() -> Iterator[None]:
    """Python's cyclic garbage collector paused while a read builds many objects, none of them garbage:
    a search of thousands of runs allocates hundreds of thousands (a run's params and tags), and the
    collector's passes over them took 2 to 3 times the read itself (6,000 runs: 17-19 s, 6-7 s paused).
    Restored after, as it was."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def newest_run(client: MlflowClient, experiment_ids: list[str], filter_string: str = "",
               wanted: Callable[[Run], bool] = lambda run: True) -> Run | None:
    """The newest run (by start time) of the search that `wanted` keeps, read a page at a time until found."""
    token = None
    while True:
        size = min(10, PAGE_SIZE) if token is None else PAGE_SIZE  # the first page small: usually it is there
        page = client.search_runs(experiment_ids, filter_string, ViewType.ACTIVE_ONLY, size,
                                  ["attributes.start_time DESC"], token)
        found = next((r for r in page if wanted(r)), None)
        token = page.token
        if found is not None or not token:
            return found


def curves_tags(history: Sequence[EvalPoint]) -> list[RunTag]:
    """The run's evaluations (step, valid_acc, train_loss) as tags, so one search returns a sweep's curves
    whole: JSON in parts of at most MLflow's 8,000 characters a tag value (`CURVES`.<i>), and `CURVES`
    saying how many. The same floats the histories hold (JSON writes a float's shortest exact form)."""
    text = json.dumps([[p.step, p.valid_acc, p.train_loss] for p in history], separators=(",", ":"))
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


def runs_in_sweep(client: MlflowClient, experiment_ids: list[str], sweep_id: str, filter_string: str = "") -> list[Run]:
    """The runs a sweep ran or resumed over (`sweeps_of`), and that `filter_string` also matches: found by the
    store (tag sweep_id; tag SWEEPS for the runs it resumed over, which add_to_sweep appended it to),
    whatever else the store holds."""
    also = f" and {filter_string}" if filter_string else ""
    ran = filter_equals(SWEEP_ID, sweep_id)  # equality: an index lookup (index_tags)
    resumed = f"tags.`{SWEEPS}` LIKE '%,{sweep_id}%'"  # after a comma: only the runs it resumed over match
    found = {r.info.run_id: r for query in (ran, resumed) for r in search_all(client, experiment_ids, query + also)}
    return [r for r in found.values() if sweep_id in sweeps_of(r)]


def find_finished(client: MlflowClient, experiment_id: str, key: str) -> Run | None:
    """A FINISHED run of the same protocol, if any (the oldest one)."""
    runs = client.search_runs([experiment_id], f"{filter_equals(PROTOCOL_KEY, key)} and attributes.status = 'FINISHED'",
                              order_by=["attributes.start_time ASC"], max_results=1)
    return runs[0] if runs else None


def recorded_process(run: Run) -> tuple[str, str, float]:
    """The host and pid a run recorded (tag HOST, `host:pid`) and its last heartbeat (its start, without one)."""
    host, _, pid = run.data.tags.get(HOST, ":").rpartition(":")
    return host, pid, float(run.data.tags.get(HEARTBEAT, run.info.start_time / 1000))


def live_runs(client: MlflowClient, experiment_id: str, key: str, stale_after_s: float,
              now: float | None = None) -> list[Run]:
    """The RUNNING runs of the same protocol whose process still runs on this host (another process than this
    one) with a heartbeat younger than `stale_after_s`: a cell that a killed sweep's worker may still train."""
    now = time.time() if now is None else now
    live = []
    for run in client.search_runs([experiment_id], f"{filter_equals(PROTOCOL_KEY, key)} and attributes.status = 'RUNNING'"):
        tags = run.data.tags
        host, pid, beat = recorded_process(run)
        if (host == socket.gethostname() and pid.isdigit() and int(pid) != os.getpid() and now - beat <= stale_after_s
                and liveness.process_alive(int(pid), tags.get(PROCESS_START))):
            live.append(run)
    return live


def wait_for_live_runs(client: MlflowClient, experiment_id: str, key: str, stale_after_s: float,
                       poll_s: float = 1.0) -> list[str]:
    """Wait while a run of the same protocol runs in another live process on this host (`live_runs`), so that a
    cell is never trained twice at once; returns the names of the runs waited for."""
    waited: list[str] = []
    while runs := live_runs(client, experiment_id, key, stale_after_s):
        for run in runs:
            if run.info.run_name not in waited:
                waited.append(run.info.run_name)
                log.info("%s: waiting for its run %s, RUNNING in process %s", run.info.run_name, run.info.run_id,
                         run.data.tags[HOST])
        time.sleep(poll_s)
    return waited


def sweeps_of(run: Run) -> list[str]:
    tags = run.data.tags
    return tags[SWEEPS].split(",") if SWEEPS in tags else [in_sweep(tags)]


def add_to_sweep(client: MlflowClient, run: Run, sweep_id: str) -> None:
    """Count a FINISHED run, skipped on resume, as part of `sweep_id` too (its own sweep_id stays)."""
    sweeps = sweeps_of(run)
    if sweep_id not in sweeps:
        client.set_tag(run.info.run_id, SWEEPS, ",".join([*sweeps, sweep_id]))


def mark_stale_runs(client: MlflowClient, experiment_id: str, stale_after_s: float,
                    now: float | None = None) -> list[str]:
    """Mark RUNNING runs whose process is gone KILLED, so nobody reads them as results.

    A run is stale when its SLURM job has ended (`sacct`, where the run ran in one), when its
    process on this host no longer exists, or when its heartbeat (refreshed at each evaluation)
    is older than `stale_after_s` at `now` (default: the current time).
    """
    now = time.time() if now is None else now
    marked = []
    for run in search_all(client, [experiment_id], "attributes.status = 'RUNNING'"):
        tags = run.data.tags
        host, pid, beat = recorded_process(run)
        ended = liveness.slurm_job_end(tags[SLURM_JOB]) if SLURM_JOB in tags else None
        if ended:
            reason = f"SLURM job {tags[SLURM_JOB]} ended {ended}"
        elif (host == socket.gethostname() and pid.isdigit()
              and not liveness.process_alive(int(pid), tags.get(PROCESS_START))):
            reason = f"process {pid} on {host} is gone"
        elif now - beat > stale_after_s:
            reason = f"no heartbeat for {now - beat:.0f} s"
        else:
            continue
        client.set_tag(run.info.run_id, KILLED_REASON, reason)
        client.set_terminated(run.info.run_id, RunStatus.to_string(RunStatus.KILLED))
        marked.append(f"{run.info.run_name} ({reason})")
    return marked


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


def log_eval_point(client: MlflowClient, run_id: str, point: EvalPoint) -> None:
    """One batch per evaluation: the metric histories, with step = optimizer step, and the heartbeat."""
    now = int(time.time() * 1000)
    names = [*metrics.HISTORIES, *(metrics.SCALER_HISTORIES if point.loss_scale is not None else ())]
    client.log_batch(run_id, metrics=[Metric(name, getattr(point, name), now, point.step) for name in names],
                     tags=[RunTag(HEARTBEAT, f"{now / 1000:.0f}")])


class MlflowLogger(Hook):
    """Every evaluation into the run, as it happens (so a crash keeps the history so far)."""

    def __init__(self, client: MlflowClient, run_id: str) -> None:
        self.client, self.run_id = client, run_id

    def after_eval(self, point: EvalPoint) -> None:
        log_eval_point(self.client, self.run_id, point)


def log_summary(client: MlflowClient, run_id: str, history: list[EvalPoint], wall_seconds: float,
                extra: Mapping[str, float] | None = None) -> None:
    """Run-level metrics at the last step: accuracy, speed, and any `extra` (e.g. memory); and the run's
    curves as tags (`curves_tags`)."""
    now, last = int(time.time() * 1000), history[-1]
    values = {
        metrics.FINAL_VALID_ACC.name: last.valid_acc,
        metrics.BEST_VALID_ACC.name: max(p.valid_acc for p in history),
        metrics.WALL_SECONDS.name: wall_seconds,
        metrics.SAMPLES_PER_SEC.name: last.samples_per_sec,
        **({metrics.SKIPPED_STEPS.name: last.skipped_steps} if last.skipped_steps is not None else {}),
        **(extra or {}),
    }
    client.log_batch(run_id, metrics=[Metric(k, v, now, last.step) for k, v in values.items()],
                     tags=curves_tags(history))


# --- what a run used and made: its datasets (the UI's Dataset column) and its model (the Models column) ---

DATA_CONTEXT = "mlflow.data.context"  # the input tag the UI shows beside a dataset's name and digest
TRAINING, VALIDATION = "training", "validation"
MODEL_NAME = "model"  # the LoggedModel's name, shown in the runs table's Models column


def data_digest(md5s: Iterable[str], selection: str) -> str:
    """32 hex characters (MLflow keeps at most 36): the MD5 of the files' MD5s, sorted, and of the selection
    of images taken from them (so a hold-out's two parts differ from each other and from the whole files)."""
    return hashlib.md5(json.dumps([sorted(md5s), selection]).encode()).hexdigest()


def dataset_input(name: str, context: str, directory: Path, files: Mapping[str, str], num_samples: int,
                  selection: str) -> DatasetInput:
    """One dataset of a run: `files` (file name -> MD5) in `directory`, of which `selection` took `num_samples`
    images: `all`, or `kept:`/`held:holdout=N:seed=S` (the two parts of gaexp.data.batches.holdout_split)."""
    profile = {"num_samples": num_samples, "selection": selection, "files_md5": dict(sorted(files.items()))}
    dataset = Dataset(name=name, digest=data_digest(files.values(), selection), source_type="local",
                      source=json.dumps({"uri": Path(directory).resolve().as_uri()}), profile=json.dumps(profile))
    return DatasetInput(dataset, tags=[InputTag(DATA_CONTEXT, context)])


def data_inputs(data_name: str, directory: Path, md5: Mapping[str, str], holdout: int, num_training: int,
                num_validation: int) -> list[DatasetInput]:
    """The run's training and validation datasets, named after the data (`data_name`, e.g. mnist) and its
    files (`md5`: IDX file name -> MD5, the train-* and t10k-* files). Without hold-out: `<data>-train` and
    `<data>-test`; with `holdout=N` both come from the training files: `<data>-train-minusN` (trained on)
    and `<data>-holdoutN` (the N held-out images, gaexp.data.batches.holdout_split)."""
    train_files = {f: m for f, m in md5.items() if f.startswith("train-")}
    test_files = {f: m for f, m in md5.items() if f.startswith("t10k-")}
    if not train_files or not test_files:
        raise ValueError(f"{data_name}: expected train-* and t10k-* files, got {sorted(md5)}")
    if not holdout:
        return [dataset_input(f"{data_name}-train", TRAINING, directory, train_files, num_training, "all"),
                dataset_input(f"{data_name}-test", VALIDATION, directory, test_files, num_validation, "all")]
    how = f"holdout={holdout}:seed={HOLDOUT_SEED}"
    return [dataset_input(f"{data_name}-train-minus{holdout}", TRAINING, directory, train_files, num_training,
                          f"kept:{how}"),
            dataset_input(f"{data_name}-holdout{holdout}", VALIDATION, directory, train_files, num_validation,
                          f"held:{how}")]


PREPROCESSING = ("size", "channels", "mean", "std", "augment")  # data keys that change what a model sees


def content_inputs(meta: Mapping[str, Any], data: Mapping[str, Any], num_training: int,
                   num_validation: int) -> list[DatasetInput]:
    """The run's training and validation datasets for data identified by content (`meta`: gaexp.data.dataset.Meta
    as a dict; `data`: the resolved data node): the digest, source, shape, classes and preprocessing, and
    which images of it each part is (`all`, or the two parts of a hold-out)."""
    preprocessing = {k: data.get(k) for k in PREPROCESSING}
    holdout = data.get("holdout") or 0
    how = f"holdout={holdout}:seed={HOLDOUT_SEED}"
    parts = ([(f"{meta['name']}-train", TRAINING, num_training, "all"),
              (f"{meta['name']}-test", VALIDATION, num_validation, "all")] if not holdout else
             [(f"{meta['name']}-train-minus{holdout}", TRAINING, num_training, f"kept:{how}"),
              (f"{meta['name']}-holdout{holdout}", VALIDATION, num_validation, f"held:{how}")])
    inputs = []
    for name, context, count, selection in parts:
        seen = {**preprocessing, "augment": preprocessing["augment"] if context == TRAINING else "none"}
        profile = {"num_samples": count, "selection": selection, "content_digest": meta["digest"],
                   "shape": list(meta["shape"]), "num_classes": meta["num_classes"], "preprocessing": seen,
                   "classes": list(meta["classes"])[:100]}
        digest = hashlib.md5(json.dumps([meta["digest"], selection, seen], sort_keys=True).encode()).hexdigest()
        dataset = Dataset(name=name, digest=digest, source_type="local" if meta["source"].startswith("file:") else "code",
                          source=json.dumps({"uri": meta["source"]}), profile=json.dumps(profile),
                          schema=json.dumps({"images": ["uint8", *meta["shape"]], "labels": "int64"}))
        inputs.append(DatasetInput(dataset, tags=[InputTag(DATA_CONTEXT, context)]))
    return inputs


def log_content_inputs(client: MlflowClient, run_id: str, meta: Mapping[str, Any], data: Mapping[str, Any],
                       num_training: int, num_validation: int) -> None:
    """`log_data_inputs` for data identified by content (every kind but idx)."""
    _log_inputs(client, run_id, content_inputs(meta, data, num_training, num_validation))


DUPLICATE = ("UNIQUE constraint failed", "Duplicate entry", "duplicate key value")  # SQLite, MySQL, PostgreSQL


def log_data_inputs(client: MlflowClient, run_id: str, data_name: str, directory: Path, md5: Mapping[str, str],
                    holdout: int, num_training: int, num_validation: int, attempts: int = 5) -> None:
    """Log the run's training and validation datasets (`data_inputs`) as its inputs.

    Cells started together race to create the same dataset row (one per experiment, name and digest):
    the store checks, both insert, and the second insert breaks the unique constraint. Its transaction
    is rolled back whole, so logging again finds the row and links it."""
    _log_inputs(client, run_id, data_inputs(data_name, directory, md5, holdout, num_training, num_validation),
                attempts)


def _log_inputs(client: MlflowClient, run_id: str, datasets: list[DatasetInput], attempts: int = 5) -> None:
    for attempt in range(attempts):
        try:
            client.log_inputs(run_id, datasets=datasets)
            return
        except MlflowException as e:
            lost_race = "datasets" in str(e) and any(m in str(e) for m in DUPLICATE)
            if not lost_race or attempt == attempts - 1:
                raise
            time.sleep(0.2 * (attempt + 1))


class _PickleChosen(logging.Filter):
    """Drops the warning MLflow logs at each pickled save: pickle is chosen on purpose (the 'pt2' graph
    format bakes train/eval mode in, so a reloaded model could not be evaluated another way)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Saving pytorch model by Pickle")


def log_model(client: MlflowClient, run_id: str, model: torch.nn.Module, step: int | None = None,
              name: str = MODEL_NAME) -> str:
    """Log `model` with MLflow's PyTorch flavour as a LoggedModel of the run (the runs table's Models
    column); returns its model id. What `mlflow.pytorch.log_model` does, through this client rather than
    the process-wide tracking URI and active run: the model pickled whole (gaexp must be importable to load
    it), the run's params, and the run's metrics at `step` (default: none) linked to it. Requirements
    are given, not inferred (inference reloads the model in a subprocess, seconds per run)."""
    import mlflow.pytorch
    mlflow_log = logging.getLogger("mlflow.pytorch")
    if not any(isinstance(f, _PickleChosen) for f in mlflow_log.filters):
        mlflow_log.addFilter(_PickleChosen())
    run = client.get_run(run_id)
    logged = client.create_logged_model(run.info.experiment_id, name=name, source_run_id=run_id,
                                        params=dict(run.data.params), model_type="pytorch")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            meta = Model(artifact_path=logged.artifact_location, run_id=run_id, model_uuid=logged.model_id,
                         model_id=logged.model_id)
            mlflow.pytorch.save_model(model, Path(tmp, "model"), mlflow_model=meta, serialization_format="pickle",
                                      pip_requirements=mlflow.pytorch.get_default_pip_requirements())
            client.log_model_artifacts(logged.model_id, str(Path(tmp, "model")))
        client.log_outputs(run_id, [LoggedModelOutput(logged.model_id, step or 0)])
        if step is not None:
            metrics = [Metric(m.key, m.value, m.timestamp, m.step, model_id=logged.model_id, run_id=run_id)
                       for key in run.data.metrics for m in client.get_metric_history(run_id, key) if m.step == step]
            client.log_batch(run_id, metrics=metrics)
    except BaseException:
        client.finalize_logged_model(logged.model_id, LoggedModelStatus.FAILED)
        raise
    client.finalize_logged_model(logged.model_id, LoggedModelStatus.READY)
    return logged.model_id


def load_model(tracking_uri: str, run_id: str, device: torch.device | str = "cpu") -> torch.nn.Module:
    """The model a run logged (`log_model`; the last one if several), on `device`, in eval mode: from a SQLite
    store or a tracking server alike, nothing retrained."""
    import mlflow.artifacts
    import mlflow.pytorch
    client = MlflowClient(tracking_uri)
    run = client.get_run(run_id)
    outputs = run.outputs.model_outputs if run.outputs else []
    if not outputs:
        raise ValueError(f"run {run.info.run_name!r} ({run_id}) in {tracking_uri} logged no model "
                         f"(status {run.info.status}; a run logs its model when its training ends)")
    logged = client.get_logged_model(outputs[-1].model_id)
    if logged.status != LoggedModelStatus.READY:
        raise ValueError(f"the model {logged.model_id} of run {run.info.run_name!r} ({run_id}) is {logged.status}, "
                         "not READY: its upload failed")
    with tempfile.TemporaryDirectory() as tmp:
        local = mlflow.artifacts.download_artifacts(artifact_uri=logged.artifact_location, dst_path=tmp,
                                                    tracking_uri=tracking_uri)
        model = mlflow.pytorch.load_model(local, map_location=device)
    return model.eval()
