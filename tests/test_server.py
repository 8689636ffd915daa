"""A team's server (gaexp.tools.server): locked with MLflow's basic-auth app; a sweep into it with credentials,
recorded whole and with no password in anything it recorded; its files owner-only, the names it answers to,
a changed admin password; and the tests' own server without MLflow's job runners."""

import base64
import os
import stat
import sys
import urllib.error
import urllib.request
from pathlib import Path
from unittest import mock

import pytest
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from gaexp.tools import server
from tests.conftest import processes

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


def test_a_server_that_cannot_start_is_one_error_with_its_log(tmp_path, free_port):
    """A server that exits before it answers (here at once, as one whose port was taken does) is the error naming
    it with its log's end, not the failure to stop the process group it no longer has."""
    argv = [sys.executable, "-c", "print('[Errno 98] error while attempting to bind: address already in use')"]
    with pytest.raises(RuntimeError, match="mlflow server did not start: .*address already in use"):
        with server.running(argv, f"http://127.0.0.1:{free_port()}", tmp_path / "server.log"):
            pass


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_a_server_outlives_no_caller_killed_outright(tmp_path, free_port):
    """A caller killed by SIGKILL runs no `finally` (a test worker killed, a benchmark's process): its server, in a
    session of its own, gets SIGTERM from the kernel and stops."""
    import signal
    import subprocess
    import time
    (tmp_path / "health").write_text("ok")  # http.server answers /health with it
    port = free_port()
    caller = subprocess.Popen([sys.executable, "-c", f"""
import sys, time
from pathlib import Path
from gaexp.tools.server import running
with running([sys.executable, "-m", "http.server", "{port}", "--bind", "127.0.0.1", "--directory", r"{tmp_path}"],
             "http://127.0.0.1:{port}", Path(r"{tmp_path}") / "server.log", "http.server") as proc:
    print(proc.pid, flush=True)
    time.sleep(600)
"""], stdout=subprocess.PIPE, text=True)
    pid = int(caller.stdout.readline())
    os.kill(pid, 0)  # serving
    caller.send_signal(signal.SIGKILL)
    caller.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.killpg(pid, signal.SIGKILL)
        pytest.fail(f"the server {pid} outlived its caller")


@pytest.fixture(scope="module")
def locked(tmp_path_factory, free_port, serve, gaexp_command):
    """The locked server, and a sweep of two cells into it whose config carries a storage URL's password."""
    root = tmp_path_factory.mktemp("locked")
    uri = f"http://127.0.0.1:{free_port()}"
    env = {**os.environ, "MLFLOW_AUTH_ADMIN_PASSWORD": PASSWORD}
    argv = [sys.executable, "-m", "gaexp.tools.server", "--host", "127.0.0.1", "--auth", "yes", "--workers", "1",
            "--port", uri.rsplit(":", 1)[1], "--root", str(root / "server")]
    with serve(argv, uri, root / "server.log", "gaexp.tools.server", env=env):
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


OLD_PASSWORD, NEW_PASSWORD = "first-admin-pass-A", "second-admin-pass-B"
NAME = "mlflow.lab.example"  # a name clients reach the server by, given in --allowed-hosts


def answer(uri: str, host: str | None = None, password: str | None = None) -> int:
    """The HTTP status of a search of experiments, with `host` as the Host header and the admin's `password`."""
    headers = {"Host": host} if host else {}
    if password:
        headers["Authorization"] = "Basic " + base64.b64encode(f"admin:{password}".encode()).decode()
    request = urllib.request.Request(f"{uri}/api/2.0/mlflow/experiments/search?max_results=1", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code


def not_owner_only(root: Path) -> dict[str, str]:
    """What in `root` (itself included) its group or others may use, with its mode."""
    return {str(p.relative_to(root)): oct(stat.S_IMODE(p.stat().st_mode)) for p in [root, *root.rglob("*")]
            if p.stat().st_mode & 0o077}


@pytest.fixture(scope="module")
def restarted(tmp_path_factory, free_port, serve):
    """A locked server started twice on a folder an older version left readable by all: first with one admin
    password and a name in --allowed-hosts (a run with an artifact logged, the Host headers tried), then with
    another password. What each start printed, the answers, and the folder."""
    base = tmp_path_factory.mktemp("restarted")
    root = base / "server"
    (root / "artifacts" / "0").mkdir(parents=True)
    (root / "artifacts" / "0" / "old.txt").write_text("from an older version")
    for path, mode in ((root, 0o755), (root / "artifacts", 0o755), (root / "artifacts" / "0", 0o755),
                       (root / "artifacts" / "0" / "old.txt", 0o644)):
        path.chmod(mode)
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "gaexp.tools.server", "--auth", "yes", "--workers", "1", "--port", str(port),
            "--root", str(root), "--allowed-hosts", f"{NAME}:{port}"]
    hosts = [f"127.0.0.1:{port}", f"localhost:{port}", f"10.1.2.3:{port}", f"{NAME}:{port}", f"evil.example:{port}"]
    first = {**os.environ, "MLFLOW_AUTH_ADMIN_PASSWORD": OLD_PASSWORD}
    with serve(argv, uri, base / "first.log", "gaexp.tools.server", env=first):
        answers = {host: answer(uri, host, OLD_PASSWORD) for host in hosts}
        with mock.patch.dict(os.environ, {"MLFLOW_TRACKING_USERNAME": "admin", "MLFLOW_TRACKING_PASSWORD": OLD_PASSWORD}):
            client = MlflowClient(uri)
            run_id = client.create_run(client.create_experiment("files")).info.run_id
            (base / "note.txt").write_text("an artifact")
            client.log_artifact(run_id, str(base / "note.txt"))
    written = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}
    readable = not_owner_only(root)  # before the second start would tighten it
    with serve(argv, uri, base / "second.log", "gaexp.tools.server", env={**first, "MLFLOW_AUTH_ADMIN_PASSWORD": NEW_PASSWORD}):
        answers["new password"] = answer(uri, password=NEW_PASSWORD)
        answers["old password"] = answer(uri, password=OLD_PASSWORD)
    yield {"root": root, "run_id": run_id, "answers": answers, "written": written, "readable": readable,
           "first": (base / "first.log").read_text(), "second": (base / "second.log").read_text()}


@pytest.mark.slow
def test_the_servers_folder_and_all_it_and_mlflow_write_there_are_its_owners_only(restarted):
    root, written = restarted["root"], restarted["written"]
    assert f"{root}: 4 file(s) and folder(s) other users could read made owner-only" in restarted["first"]
    artifact = next(p for p in written if p.endswith(f"{restarted['run_id']}/artifacts/note.txt"))
    assert {"mlflow.db", "basic_auth.db", "basic_auth.ini", "flask_secret", artifact} <= written
    assert not restarted["readable"]  # all the first start found or made, as it stopped
    assert "made owner-only" not in restarted["second"]


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_the_root_folders_parents_keep_their_usual_mode_and_a_bad_root_is_one_line(tmp_path):
    server.prepare(parsed("--root", str(tmp_path / "outputs" / "server")), {})
    assert stat.S_IMODE((tmp_path / "outputs" / "server").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "outputs").stat().st_mode) == 0o777 & ~current_umask()
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=f"^--root {tmp_path}/file/server: {tmp_path}/file: not a folder; valid: "):
        server.prepare(parsed("--root", str(tmp_path / "file" / "server")), {})


@pytest.mark.slow
def test_allowed_hosts_adds_its_names_to_mlflows_default_loopback_and_private_ips(restarted):
    answers = {host: code for host, code in restarted["answers"].items() if ":" in host}
    assert answers == {host: 403 if host.startswith("evil.") else 200 for host in answers}


@pytest.mark.slow
def test_a_new_admin_password_replaces_the_old_one_at_restart_and_says_so(restarted):
    assert restarted["answers"]["new password"] == 200 and restarted["answers"]["old password"] == 401
    assert "admin's password changed to the one in MLFLOW_AUTH_ADMIN_PASSWORD" in restarted["second"]
    assert "password changed" not in restarted["first"]
    assert NEW_PASSWORD not in restarted["second"] and OLD_PASSWORD not in restarted["first"]


@pytest.mark.slow
def test_the_tests_server_runs_without_mlflows_job_runners(server):
    _, root = server
    every = processes()
    leader = next(pid for pid, group, line in every if pid == group and f"sqlite:///{root}/mlflow.db" in line)
    group = [line for _, group, line in every if group == leader]
    assert len(group) > 1 and not [line for line in group if "mlflow.server.jobs" in line or "huey" in line]
