"""`make ui` (gaexp.tools.ui): the experiments tagged as model training, the printed links, and, in a real headless
Chromium against a real `mlflow ui`, that the link opens the runs table."""

from __future__ import annotations

import html
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from gaexp import tracking
from gaexp.tools import ui
from gaexp import tags as runtags
from tests.conftest import processes

REPO = Path(__file__).resolve().parent.parent

RUN_NAMES = ("bn-bs1a16-s1", "gn4-bs16a1-s2")
CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)


def make_store(root: Path, tagged: bool = True) -> tuple[str, str]:
    """A SQLite store with two finished runs in experiment `gaexp`: made by prepare_store (tagged), or as a
    store made before the tag was (plain create_experiment)."""
    uri = f"sqlite:///{root}/mlflow.db"
    if tagged:
        experiment_id = tracking.prepare_store(uri, "gaexp", str(root / "artifacts"))
    else:
        experiment_id = MlflowClient(uri).create_experiment("gaexp", artifact_location=(root / "artifacts").as_uri())
    client = MlflowClient(uri)
    for name in RUN_NAMES:
        with tracking.tracked_run(client, experiment_id, name, {"norm": name.split("-")[0]}) as run_id:
            client.log_metric(run_id, "valid_acc", 0.9, step=2)
    return uri, experiment_id


def test_runs_link_is_the_experiment_page_on_the_runs_table():
    assert ui.runs_link("http://127.0.0.1:5000", "7") == "http://127.0.0.1:5000/#/experiments/7?workflowType=machine_learning"
    assert ui.runs_link("http://h:1/", "0") == "http://h:1/#/experiments/0?workflowType=machine_learning"
    assert ui.base_url("127.0.0.1", 5000) == "http://127.0.0.1:5000"
    assert ui.base_url("0.0.0.0", 8080) == "http://127.0.0.1:8080"
    assert ui.base_url("::", 5000) == "http://[::1]:5000"


@pytest.mark.parametrize("tagged", [True, False], ids=["made-by-prepare_store", "made-before-the-tag"])
def test_every_experiment_with_runs_is_tagged_as_model_training(tmp_path, tagged):
    uri, experiment_id = make_store(tmp_path, tagged)
    client = MlflowClient(uri)
    assert (client.get_experiment(experiment_id).tags.get(runtags.EXPERIMENT_KIND[0]) == runtags.EXPERIMENT_KIND[1]) is tagged
    assert ui.tag_experiments(uri) == [(experiment_id, "gaexp", 2)]  # MLflow's empty Default experiment left out
    assert client.get_experiment(experiment_id).tags[runtags.EXPERIMENT_KIND[0]] == runtags.EXPERIMENT_KIND[1]
    assert runtags.EXPERIMENT_KIND[0] not in client.get_experiment("0").tags


def test_cli_prints_each_link_then_becomes_mlflow_ui(tmp_path, monkeypatch, capsys):
    uri, experiment_id = make_store(tmp_path, tagged=False)
    execs = []
    monkeypatch.setattr(ui.os, "execve", lambda path, argv, env: execs.append((path, argv, env["PYTHONWARNINGS"])))
    monkeypatch.setenv("PYTHONWARNINGS", "error::ResourceWarning")
    ui.main(["--store", uri, "--port", "5123"])
    assert capsys.readouterr().out == (
        f"gaexp: 2 runs  http://127.0.0.1:5123/#/experiments/{experiment_id}?workflowType=machine_learning\n")
    mlflow = str(Path(sys.executable).parent / "mlflow")
    assert execs == [(mlflow, [mlflow, "ui", "--backend-store-uri", uri, "--host", "127.0.0.1", "--port", "5123"],
                      f"error::ResourceWarning,{ui.QUIET_WARNINGS}")]  # the user's filters kept
    assert MlflowClient(uri).get_experiment(experiment_id).tags[runtags.EXPERIMENT_KIND[0]] == runtags.EXPERIMENT_KIND[1]


@pytest.mark.parametrize("args, message", [
    (["--port", "http"], "error: --port=http; valid: an integer in [1, 65535]"),
    (["--port", "70000"], "error: --port=70000; valid: an integer in [1, 65535]"),
    (["--store", "http://127.0.0.1:9"], "error: MLflow tracking server http://127.0.0.1:9 unreachable: "),
    (["--store", "sqlite:///rel/mlflow.db"], "error: --store=sqlite:///rel/mlflow.db; valid: sqlite:///ABSOLUTE/PATH.db"),
    (["--store", "postgresql://h/db"], "error: --store=postgresql://h/db; valid: sqlite:///ABSOLUTE/PATH.db"),
])
def test_bad_input_is_one_line_naming_the_value(args, message, monkeypatch):
    monkeypatch.setattr(ui.os, "execve", lambda *a: pytest.fail("exec on bad input"))
    with pytest.raises(SystemExit) as stop:
        ui.main(args)
    assert str(stop.value).startswith(message) and "\n" not in str(stop.value)


def test_a_servers_store_gets_the_links_at_the_servers_address_and_nothing_started(monkeypatch, capsys):
    """`make ui STORE=http://HOST:PORT`: the server is the UI; its experiments are tagged and linked there."""
    monkeypatch.setattr(ui.os, "execve", lambda *a: pytest.fail("a second UI started for a server"))
    monkeypatch.setattr(ui.tracking, "check_server", lambda uri: None)
    monkeypatch.setattr(ui, "tag_experiments", lambda uri: [("7", "gaexp", 12)] if uri == "http://lab:5000" else [])
    ui.main(["--store", "http://lab:5000"])
    assert capsys.readouterr().out == ("gaexp: 12 runs  http://lab:5000/#/experiments/7?workflowType=machine_learning\n"
                                       "http://lab:5000 serves its own UI\n")


def test_the_uis_server_processes_print_no_starlette_deprecation(tmp_path):
    """`make ui` printed Starlette's deprecation of a module MLflow's server imports, once per worker (4 lines
    each): the environment `mlflow ui` is given filters that one warning out, and only it."""
    def imported(env: dict) -> str:
        return subprocess.run([sys.executable, "-c", "import warnings; import mlflow.server.fastapi_app; "
                               "warnings.warn('starlette.middleware.other is deprecated')"], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=300).stderr
    plain = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    if "starlette.middleware.wsgi is deprecated" not in imported(plain):
        pytest.skip("MLflow's server no longer imports a deprecated Starlette module: nothing to filter")
    printed = imported(ui.ui_environment(plain))
    assert "starlette.middleware.wsgi is deprecated" not in printed
    assert "starlette.middleware.other is deprecated" in printed  # other warnings still show


def test_make_ui_takes_the_store_to_show():
    dry = subprocess.run(["make", "-n", "ui", "STORE=sqlite:////srv/team/mlflow.db", "PORT=5001"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0 and "-m gaexp.tools.ui --store sqlite:////srv/team/mlflow.db --host 127.0.0.1 --port 5001" \
        in dry.stdout


def test_a_missing_store_says_to_run_a_sweep_first(tmp_path, monkeypatch):
    monkeypatch.setattr(ui.os, "execve", lambda *a: pytest.fail("exec without a store"))
    with pytest.raises(SystemExit, match=f"error: no MLflow store at {tmp_path}/none.db; run `make sweep` first"):
        ui.main(["--store", f"sqlite:///{tmp_path}/none.db"])
    assert not (tmp_path / "none.db").exists()


# --- in a real browser --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ui_server(tmp_path_factory, free_port, serve):
    """`python -m gaexp.tools.ui` on a small store made before the tag: (the link it printed, its process's output file).
    The UI runs until the module's tests end (its whole process group is stopped)."""
    if CHROMIUM is None:
        pytest.skip("no chromium on PATH (Debian: apt-get install chromium)")
    root = tmp_path_factory.mktemp("ui")
    uri, _ = make_store(root, tagged=False)
    port = free_port()
    log_path = root / "ui.log"
    with serve([sys.executable, "-m", "gaexp.tools.ui", "--store", uri, "--port", str(port)], f"http://127.0.0.1:{port}",
               log_path, "mlflow ui"):
        link = re.search(r"^gaexp: 2 runs  (\S+)$", log_path.read_text(), re.M)
        assert link, log_path.read_text()[-2000:]
        yield link[1], root


def rendered(url: str, profile: Path) -> str:
    """The DOM headless Chromium renders at `url` after 15 s of virtual time (a fresh profile: no saved view)."""
    done = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                           f"--user-data-dir={profile}", "--window-size=1400,800", "--virtual-time-budget=15000",
                           "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "</html>" in done.stdout, done.stderr[-2000:]
    return done.stdout


def title(dom: str) -> str:
    return re.search(r"<title>(.*?)</title>", dom, re.S)[1]


def visible_text(dom: str) -> str:
    """The page's text as a reader sees it: markup, scripts and styles removed, spaces collapsed."""
    dom = re.sub(r"<(script|style)\b.*?</\1>", " ", dom, flags=re.S)
    return html.unescape(" ".join(re.sub(r"<[^>]+>", "", dom).split()))


@pytest.mark.slow
@pytest.mark.browser
def test_the_printed_link_opens_the_runs_table(ui_server):
    link, root = ui_server
    dom = rendered(link, root / "profile-link")
    text = visible_text(dom)
    assert title(dom).startswith("Runs - Experiment ")
    assert "Run Name" in text and "2 matching runs" in text and all(name in text for name in RUN_NAMES)


@pytest.mark.slow
@pytest.mark.browser
def test_the_ui_starts_none_of_mlflows_job_runners(ui_server):
    """`mlflow ui` starts MLflow's GenAI job runners by default (8 huey processes, about 20 s of CPU): the UI gaexp
    starts runs without them, as its server does. A value the user set is kept."""
    _, root = ui_server
    every = processes()
    leader = next(pid for pid, group, line in every if pid == group and f"sqlite:///{root}/mlflow.db" in line)
    group = [line for _, group, line in every if group == leader]
    assert len(group) > 1 and not [line for line in group if "mlflow.server.jobs" in line or "huey" in line], group
    assert ui.ui_environment({"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "true"})["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "true"


def test_without_the_parameter_the_ui_opens_on_the_genai_overview(ui_server):
    """Why the link carries ?workflowType=machine_learning: MLflow 3.17's UI picks the view from the URL (or what
    the browser saved), not from the experiment's tag; the bare page is the GenAI overview, with no run in sight.
    If this fails, the UI changed and the parameter may no longer be needed."""
    link, root = ui_server
    dom = rendered(link.split("?")[0], root / "profile-bare")
    text = visible_text(dom)
    assert title(dom).startswith("Overview - Experiment ") and "Traces" in text
    assert "Run Name" not in text and not any(name in dom for name in RUN_NAMES)
