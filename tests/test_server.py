"""A team's server (gaexp.server): locked with MLflow's basic-auth app; a sweep into it with credentials,
recorded whole and with no password in anything it recorded."""

import os
import sys
from pathlib import Path

import pytest
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from gaexp import server

PASSWORD = "admin-pass-4-tests"  # the admin's: in the environment only
STORAGE_SECRET = "s3cr3t-PW"  # in a storage URL the config carries
STORAGE = f"postgresql://alice:{STORAGE_SECRET}@db.example:5432/optuna"
CELLS = ["gn4-bs4a4-s1", "gn4-bs16a1-s1"]


def parsed(*argv):
    return server.parser().parse_args(list(argv))


def test_a_server_beyond_the_loopback_is_locked_and_needs_the_admins_password(tmp_path):
    with pytest.raises(ValueError, match="MLFLOW_AUTH_ADMIN_PASSWORD"):
        server.prepare(parsed("--host", "0.0.0.0", "--root", str(tmp_path)), {})
    argv, env = server.prepare(parsed("--host", "0.0.0.0", "--root", str(tmp_path)), {"MLFLOW_AUTH_ADMIN_PASSWORD": PASSWORD})
    assert argv[-2:] == ["--app-name", "basic-auth"] and PASSWORD not in " ".join(argv)
    assert PASSWORD not in Path(env["MLFLOW_AUTH_CONFIG_PATH"]).read_text()
    argv, _ = server.prepare(parsed("--root", str(tmp_path)), {})
    assert "--app-name" not in argv  # the loopback: only this machine reaches it
    with pytest.raises(ValueError, match="--auth no with --host 0.0.0.0"):
        server.prepare(parsed("--host", "0.0.0.0", "--auth", "no", "--root", str(tmp_path)), {})


@pytest.fixture(scope="module")
def locked(tmp_path_factory, free_port, serve, gaexp_command):
    """The locked server, and a sweep of two cells into it whose config carries a storage URL's password."""
    root = tmp_path_factory.mktemp("locked")
    uri = f"http://127.0.0.1:{free_port()}"
    env = {**os.environ, "MLFLOW_AUTH_ADMIN_PASSWORD": PASSWORD}
    argv = [sys.executable, "-m", "gaexp.server", "--host", "127.0.0.1", "--auth", "yes", "--workers", "1",
            "--port", uri.rsplit(":", 1)[1], "--root", str(root / "server")]
    with serve(argv, uri, root / "server.log", "gaexp.server", env=env):
        out = root / "out"
        out.mkdir()
        creds = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
        creds |= {"MLFLOW_TRACKING_USERNAME": "admin", "MLFLOW_TRACKING_PASSWORD": PASSWORD}
        done = gaexp_command(out, "norm=gn4", "regime=bs4a4,bs16a1", f"mlflow.tracking_uri={uri}",
                             f"optuna.storage={STORAGE}", "launch=joblib", "hydra.launcher.n_jobs=1", env=creds)
        yield uri, out, done, creds


@pytest.mark.slow
def test_an_unauthenticated_write_is_refused_and_an_authenticated_sweep_is_recorded_whole(locked, monkeypatch):
    uri, _, done, creds = locked
    assert done.returncode == 0, done.stderr[-3000:]
    for key in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(MlflowException, match="401"):
        MlflowClient(uri).create_experiment("intruder")
    with pytest.raises(MlflowException, match="401"):
        MlflowClient(uri).search_experiments()
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "admin")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", PASSWORD)
    client = MlflowClient(uri)
    runs = {r.info.run_name: r for r in client.search_runs([client.get_experiment_by_name("gaexp").experiment_id])}
    assert {name: runs[name].info.status for name in CELLS} == {name: "FINISHED" for name in CELLS}
    for name in CELLS:
        assert [m.step for m in client.get_metric_history(runs[name].info.run_id, "valid_acc")][:2] == [2, 4]
        assert {a.path for a in client.list_artifacts(runs[name].info.run_id)} >= {"config.yaml", "hydra"}
    assert any(n.startswith("report-") for n in runs) and any(n.startswith("sweep-") for n in runs)


@pytest.mark.slow
def test_no_password_is_in_any_param_tag_artifact_log_or_report_of_the_sweep(locked, monkeypatch, tmp_path):
    uri, out, done, creds = locked
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "admin")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", PASSWORD)
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("gaexp").experiment_id])
    texts = {"stdout": done.stdout, "stderr": done.stderr}
    for run in runs:
        texts |= {f"{run.info.run_name} param {k}": v for k, v in run.data.params.items()}
        texts |= {f"{run.info.run_name} tag {k}": v for k, v in run.data.tags.items()}
        folder = Path(client.download_artifacts(run.info.run_id, "", str(tmp_path / run.info.run_id)))
        texts |= {f"{run.info.run_name} artifact {p.relative_to(folder)}": p.read_bytes().decode("utf-8", "replace")
                  for p in folder.rglob("*") if p.is_file()}
    texts |= {f"file {p.relative_to(out)}": p.read_text() for p in out.rglob("*")
              if p.is_file() and (p.suffix == ".log" or "reports" in p.parts) and p.suffix in (".log", ".md", ".csv")}
    leaked = {where: [line for line in text.splitlines() if STORAGE_SECRET in line or PASSWORD in line][:2]
              for where, text in texts.items() if STORAGE_SECRET in text or PASSWORD in text}
    assert not leaked
    cells = [r for r in runs if r.info.run_name in CELLS]
    assert {r.data.params["optuna.storage"] for r in cells} == {"postgresql://alice:***@db.example:5432/optuna"}
    assert any("config.yaml" in w for w in texts) and any(w.endswith(".log") for w in texts)
