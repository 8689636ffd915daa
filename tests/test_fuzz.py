"""Bad input, fuzzed: every value below gets one line `error: ...` naming it and what is valid, exit code 1, and
nothing created (no MLflow store, no Optuna storage) before any training (docs/reliability.md#bad-input).

Most cases run in this process through the code the command runs first: `gaexp.app.cli`'s check of the command
line, or PrepareCallback (which runs `prepare`: the cell's checks, each swept value, gaexp's sweeper's settings)
on the composed config. A few run as the real command, one per path, to show the line is all the terminal gets.
"""

from __future__ import annotations

import os
import re
import sys

import pytest

from gaexp import app, liveness
from gaexp.data import custom
from gaexp.callbacks import PrepareCallback
from tests.conftest import TINY

HUGE = "99999999999999999999"  # > 2**63: Python's int, no torch's or numpy's
NOT_A_PORT = "mysql+pymysql://opt:pw@127.0.0.1:notaport/optuna"  # the password must never be shown
OPTUNA = ["hydra/sweeper=gaexp_optuna", "hydra.sweeper.direction=maximize"]
GIB = 2**30


def created(root):
    """What a command must not have made under `root` on bad input: an MLflow store (SQLite file, artifacts) or an
    Optuna storage."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if p.suffix in (".db", ".journal", ".sqlite") or p.name == "mlartifacts")


def one_error_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), text[-3000:]
    return lines[0]


@pytest.fixture
def isolated(monkeypatch):
    """What the command's first steps change in a process, put back after: the terminal's streams (masked), the
    import path (the current folder), the sweep's process mark."""
    monkeypatch.setattr(sys, "stdout", sys.stdout)
    monkeypatch.setattr(sys, "stderr", sys.stderr)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setitem(os.environ, liveness.SWEEP_PROCESS, "")


# --- refused by the command line's check, before Hydra runs (gaexp.app.cli) ------------------------------------

COMMAND_LINE = {
    "unknown norm": (["norm=batchnorm"], r"norm=batchnorm: no such norm; valid: bn, "),
    "unknown dataset": (["data=nonexistent"], r"data=nonexistent: no such data; valid: cifar10, "),
    "unknown key": (["train.lrr=0.1"], r"train.lrr: no key 'lrr' in train; valid: .*did you mean train.lr"),
    "float for an integer": (["regime.batch_size=1.5"], r"regime.batch_size.*1.5"),
    "text for a number": (["train.lr=fast"], r"train.lr.*fast"),
    "unicode, unquoted": (["mlflow.experiment_name=ünï😀 name"], r"mlflow.experiment_name=ünï😀 name"),
}


@pytest.mark.parametrize("case", list(COMMAND_LINE))
def test_the_command_line_check_refuses_in_one_line(case, tmp_path, isolated, monkeypatch):
    overrides, message = COMMAND_LINE[case]
    monkeypatch.setattr(app, "main", lambda: pytest.fail("the check let it through to Hydra"))
    with pytest.raises(SystemExit) as info:
        app.cli(["-m", *TINY, f"paths.outputs={tmp_path}", *overrides])
    assert re.search(message, one_error_line(str(info.value))), str(info.value)
    assert created(tmp_path) == []


# --- refused by PrepareCallback, the first thing Hydra runs: before the store, the data or a sweeper ---------

PREPARE = {
    # integers beyond int64 (torch raised deep in a run, after the store; seeds: torch.manual_seed's overflow)
    "iterations beyond int64": ([f"train.num_iterations={HUGE}"],
                                rf"train.num_iterations={HUGE}; valid: an integer >= 1, within int64"),
    "seed beyond int64": (["seed=1180591620717411303424"], r"seed=1180591620717411303424; valid: an integer in \[0, "),
    "negative seed": (["seed=-1", "data.augment=crop_flip"], r"seed=-1; valid: an integer in \[0, 2\*\*63 - 1\]"),
    "eval batch beyond int64": ([f"train.eval_batch_size={HUGE}"], rf"train.eval_batch_size={HUGE}; valid: an integer"),
    "groups beyond int64": (["norm=gn", f"norm.groups={HUGE}"], rf"norm.groups={HUGE}; valid: an integer >= 1, within"),
    "threads, a million": (["threads=1000000"], r"threads=1000000; valid: auto or an integer in \[0, 1024\]"),
    # names MLflow refuses after the store is made
    "empty experiment name": (["mlflow.experiment_name=''"], r"mlflow.experiment_name=''; valid: a name of 1 to 500 "),
    "experiment name too long": ([f"mlflow.experiment_name={'x' * 501}"],
                                 r"mlflow.experiment_name='xxx.*\(501 characters\); valid: a name of 1 to 500"),
    "dataset name too long": ([f"data.dataset={'d' * 7000}"], r"data.dataset='ddd.*\(7,000 characters\); valid: a "
                                                              r"name of 1 to 200 characters"),
    "empty outputs folder": (["paths.outputs=''"], r"paths.outputs=''; valid: a folder"),  # else /mlflow.db, /data
    # bounds before work (issue 46, item 7)
    "batch larger than the data": (["regime.batch_size=70000"],
                                   r"regime.batch_size=70000; valid: an integer in \[1, 60000\]: a micro-batch is at "
                                   r"most the 60,000 training images of data=mnist"),
    "batch larger than what the holdout leaves": (["data.holdout=59990"],
                                                  r"regime.batch_size=16; valid: an integer in \[1, 10\]: .* left "
                                                  r"after data.holdout=59,990"),
    "batched step larger than the data": (["accumulate=batched", "regime.batch_size=16", "regime.num_accum=5000"],
                                          r"regime.batch_size\*regime.num_accum=80000; valid: at most 60000: "
                                          r"accumulate=batched computes a step's 16 x 5000 samples at once"),
    "a loss record beyond memory": (["train.num_iterations=4611686018427387904"],
                                    r"train.num_iterations=4611686018427387904: a run needs about .* GiB on cpu .*; "
                                    r"valid: train.num_iterations <= "),
    # what already held
    "lr nan": (["train.lr=nan"], r"train.lr=nan; valid: a finite number > 0"),
    "lr inf": (["train.lr=inf"], r"train.lr=inf; valid: a finite number > 0"),
    "lr overflowing to inf": (["train.lr=1e400"], r"train.lr=inf; valid: a finite number > 0"),
    "no accumulation": (["regime.num_accum=0"], r"regime.num_accum=0; valid: an integer >= 1"),
    "negative batch": (["regime.batch_size=-3"], r"regime.batch_size=-3; valid: an integer >= 1"),
    "negative threads": (["threads=-5"], r"threads=-5; valid: auto or an integer >= 0"),
    "holdout of every image": (["data.holdout=60000"], r"data.holdout=60000; valid: an integer in \[0, 60000\)"),
    "unknown device": (["device=tpu"], r"device='tpu'; valid: auto, cpu, cuda"),
    "file store": (["mlflow.tracking_uri=./mlruns"], r"mlflow.tracking_uri='./mlruns'; valid: sqlite:///"),
    # gaexp's sweepers' settings (Hydra makes a sweeper after this callback: they were checked after the store)
    "storage port": ([*OPTUNA, f"hydra.sweeper.storage={NOT_A_PORT}"],
                     r"hydra.sweeper.storage='mysql\+pymysql://opt:\*\*\*@127.0.0.1:notaport/optuna': its port is not "
                     r"an integer; valid: an RDB URL"),
    "storage dialect": ([*OPTUNA, "hydra.sweeper.storage=foo://bar/baz"],
                        r"hydra.sweeper.storage='foo://bar/baz': SQLAlchemy has no dialect\+driver 'foo'; valid: "),
    "storage in memory": ([*OPTUNA, "hydra.sweeper.storage=sqlite://"], r"hydra.sweeper.storage='sqlite://': SQLite "
                                                                          r"in memory"),
    "storage a folder": ([*OPTUNA, "hydra.sweeper.storage=/"], r"hydra.sweeper.storage='/': a folder, not a journal"),
    "study name with a quote": ([*OPTUNA, """hydra.sweeper.study_name='it\\'s "q"'"""],
                                r"""hydra.sweeper.study_name='it\\'s "q"': MLflow's run search.* valid: a name """
                                r"without '"),
    "no trials": ([*OPTUNA, "hydra.sweeper.n_trials=0"], r"hydra.sweeper.n_trials=0; valid: an integer >= 1"),
    "grid sweeper's poll": (["hydra.sweeper.poll_s=0"], r"hydra.sweeper.poll_s=0.0; valid: seconds > 0"),
}


@pytest.mark.parametrize("case", list(PREPARE))
def test_prepare_refuses_in_one_line_before_anything_is_created(case, tmp_path, compose, isolated):
    overrides, message = PREPARE[case]
    cfg = compose(*TINY, "data.holdout=0", *overrides, outputs=tmp_path, hydra=True)
    with pytest.raises(SystemExit) as info:
        PrepareCallback().on_multirun_start(cfg)
    line = one_error_line(str(info.value))
    assert re.search(message, line), line
    assert "pw@" not in line and created(tmp_path) == []


def test_a_batch_larger_than_data_whose_size_only_its_reading_tells_is_refused(tmp_path, compose, isolated,
                                                                                monkeypatch):
    """A loader's (or a folder's) image count is known once prepare reads it: the batch is checked there, before
    the store."""
    (tmp_path / "twelve_images.py").write_text(
        "import torch\n\n"
        "def tensors(n=12):\n"
        "    images, labels = torch.zeros(n, 1, 28, 28, dtype=torch.uint8), torch.arange(n) % 10\n"
        "    return (images, labels), (images[:4], labels[:4])\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.raises(SystemExit) as info:
            PrepareCallback().on_multirun_start(compose(*TINY, "data.holdout=0", "data=custom", "data.target=twelve_images:tensors",
                                                        "regime=bs16a1", outputs=tmp_path / "out", hydra=True))
    finally:
        custom._load_custom.cache_clear()
        sys.modules.pop("twelve_images", None)
    assert one_error_line(str(info.value)) == ("error: regime.batch_size=16; valid: an integer in [1, 12]: a "
                                               "micro-batch is at most the 12 training images of data=custom")
    assert created(tmp_path) == []


def test_a_step_beyond_this_machines_memory_is_refused_naming_what_to_lower(tmp_path, compose, isolated,
                                                                            monkeypatch):
    """The estimate (activations of the samples a step holds at once, data, model, loss record) against the memory
    here, made 1 GiB: the loop holds a micro-batch, accumulate=batched a step's b*k samples."""
    monkeypatch.setattr("gaexp.memory.available_bytes", lambda device: (GIB, "available on this machine (MemAvailable)"))
    cases = {("regime.batch_size=50000",): r"regime.batch_size=50000: a run needs about 2\d\.\d GiB on cpu \(50,000 "
                                           r"samples x 0.\d MiB of activations; .* of data; .*\), more than the 1.0 "
                                           r"GiB available on this machine \(MemAvailable\); valid: "
                                           r"regime.batch_size <= \d,\d\d\d$",
             ("regime.batch_size=4", "regime.num_accum=4096", "accumulate=batched"):
                 r"regime.batch_size=4 regime.num_accum=4096 accumulate=batched: a run needs about .* GiB .*; valid: "
                 r"regime.batch_size x regime.num_accum <= \d,\d\d\d \(or accumulate=loop"}
    for overrides, message in cases.items():
        with pytest.raises(SystemExit) as info:
            PrepareCallback().on_multirun_start(compose(*TINY, *overrides, outputs=tmp_path, hydra=True))
        assert re.search(message, one_error_line(str(info.value))), str(info.value)
    assert created(tmp_path) == []
    PrepareCallback().on_multirun_start(compose(*TINY, "regime.batch_size=1000", outputs=tmp_path, hydra=True))
    assert "mlflow.db" in created(tmp_path)  # what fits goes on: the store is made


# --- the real command, one case per path: the terminal gets the one line and the folder nothing ---------------

COMMANDS = {
    "command line": (["data=nonexistent"], r"error: data=nonexistent: no such data; valid: "),
    "prepare": ([f"train.num_iterations={HUGE}"], rf"error: train.num_iterations={HUGE}; valid: an integer >= 1, "),
    "relative store": (["mlflow.tracking_uri=sqlite:///relative.db"],
                       r"error: mlflow.tracking_uri='sqlite:///relative.db'; valid: sqlite:///ABSOLUTE/PATH.db, e.g. "
                       r"sqlite:////.*/relative.db"),
    "a swept value": (["regime.batch_size=16,70000"], r"error: cell regime.batch_size=70000: regime.batch_size=70000; "
                                                      r"valid: an integer in \[1, 59500\]: a micro-batch is at most "
                                                      r"the 59,500 training images of data=mnist left after "
                                                      r"data.holdout=500"),
    "the sweeper's storage": (["+experiment=tune_lr", f"hydra.sweeper.storage={NOT_A_PORT}"],
                              r"error: hydra.sweeper.storage='mysql\+pymysql://opt:\*\*\*@127.0.0.1:notaport/optuna': "
                              r"its port is not an integer"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(COMMANDS))
def test_the_command_prints_one_line_exits_1_and_creates_nothing(case, tmp_path, gaexp_command):
    overrides, message = COMMANDS[case]
    result = gaexp_command(tmp_path, *overrides)
    assert result.returncode == 1, result.stderr[-3000:]
    line = one_error_line(result.stderr)
    assert re.fullmatch(message + ".*", line), line
    assert "pw@" not in result.stderr + result.stdout
    assert created(tmp_path) == []  # relative.db would be here, the command's folder
