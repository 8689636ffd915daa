"""What a run used: its datasets as MLflow inputs (the UI's Dataset column), identified by their files' MD5s or by
their content digest, with the preprocessing that changes what a model sees.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any, Iterable, Mapping

from mlflow.entities import Dataset, DatasetInput, InputTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from gaexp.config import HOLDOUT_SEED


DATA_CONTEXT = "mlflow.data.context"  # the input tag the UI shows beside a dataset's name and digest


TRAINING, VALIDATION = "training", "validation"


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
