"""The store, prepared once per command: its server checked (a password sent as basic auth, never recorded),
the experiment made with an explicit artifact location, a SQLite store's tags indexed.
"""

from __future__ import annotations

import base64
import os
import sqlite3
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from gaexp.redact import mask
from gaexp.tags import EXPERIMENT_KIND


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
