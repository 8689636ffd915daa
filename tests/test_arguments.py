"""gaexp/arguments.py: a damaged SQLite store gets one line naming its file and SQLite's cause, from every console
script that reads a store, and is never written by the check."""

from __future__ import annotations

import argparse
import random
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from gaexp import analysis, arguments, progress, tracking
from tests.conftest import add_run

BIN = Path(sys.executable).parent
# Every console script that reads a store through arguments.require_store, as a user types it (`make ui` is gaexp.tools.ui).
COMMANDS = {
    "gaexp-status": [str(BIN / "gaexp-status")],
    "gaexp-report": [str(BIN / "gaexp-report"), "--no-plots"],
    "gaexp-tuned": [str(BIN / "gaexp-tuned")],
    "eta_replay": [sys.executable, "-m", "gaexp.tools.eta_replay"],
}
MALFORMED, NOT_A_DATABASE = "database disk image is malformed", "file is not a database"
PAGE = 4096  # MLflow's SQLite stores' page size (checked in the fixture)


def write_store(path: Path) -> None:
    """A real store: 6 finished runs of one sweep, written through MLflow's client."""
    uri = f"sqlite:///{path}"
    experiment_id = tracking.prepare_store(uri, "gaexp", str(path.parent / "artifacts"))
    client = MlflowClient(uri)
    for seed in (1, 2, 3):
        for regime in ("bs16a1", "bs1a16"):
            add_run(client, experiment_id, "bn", regime, seed, (0.9, 0.91, 0.92))


def page_of(path: Path, table: str) -> int:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        assert db.execute("PRAGMA page_size").fetchone()[0] == PAGE
        return db.execute("SELECT rootpage FROM sqlite_master WHERE name = ?", (table,)).fetchone()[0]


def overwrite_page(data: bytes, page: int, noise: bytes | None = None) -> bytes:
    """`data` with page `page` (1-based) replaced by `noise` (default: random bytes)."""
    noise = random.Random(0).randbytes(PAGE) if noise is None else noise
    return data[:(page - 1) * PAGE] + noise + data[page * PAGE:]


@pytest.fixture(scope="module")
def damaged(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """A real store damaged three ways: {damage: (file, the cause SQLite gives)}."""
    folder = tmp_path_factory.mktemp("store")
    good = folder / "mlflow.db"
    write_store(good)
    data = good.read_bytes()
    pages = len(data) // PAGE
    assert pages > 100  # a middle page well away from the header and the schema
    damages = {
        "truncated": (data[:len(data) // 2], MALFORMED),
        "zeroed header": (bytes(100) + data[100:], NOT_A_DATABASE),
        "random page": (overwrite_page(data, pages // 2), MALFORMED),
    }
    made = {}
    for name, (content, cause) in damages.items():
        path = folder / name / "mlflow.db"  # a space in the path, as a user's folder may have
        path.parent.mkdir()
        path.write_bytes(content)
        made[name] = (path, cause)
    return made


def test_require_store_names_the_file_and_sqlites_cause_and_writes_nothing(damaged, tmp_path):
    for name, (path, cause) in damaged.items():
        before = path.read_bytes()
        with pytest.raises(SystemExit) as e:
            arguments.require_store(f"sqlite:///{path}")
        message = str(e.value)
        assert message.startswith(f"error: the MLflow store {path} cannot be read: {cause}"), name
        assert "\n" not in message
        assert path.read_bytes() == before, name
    write_store(tmp_path / "mlflow.db")
    arguments.require_store(f"sqlite:///{tmp_path / 'mlflow.db'}")  # a sound store passes


def test_an_emptied_file_is_refused_not_made_into_a_new_store(tmp_path):
    path = tmp_path / "mlflow.db"
    path.write_bytes(b"")
    with pytest.raises(SystemExit, match=f"^error: the MLflow store {path} cannot be read: no MLflow tables in it"):
        arguments.require_store(f"sqlite:///{path}")
    assert path.read_bytes() == b""


@pytest.mark.parametrize("main, argv", [(progress.main, []), (analysis.main, ["--no-plots"])],
                         ids=["gaexp-status", "gaexp-report"])
def test_damage_past_the_checked_size_still_ends_in_one_line(tmp_path, monkeypatch, main, argv):
    """A store larger than FULL_CHECK_BYTES has its header and schema checked only: a damaged page of its
    runs table (zeroed: no b-tree page, whatever reads it) shows when MLflow reads it, and gives the same one
    line."""
    written, path = tmp_path / "written" / "mlflow.db", tmp_path / "mlflow.db"  # a copy: no cached pages of it here
    written.parent.mkdir()
    write_store(written)
    path.write_bytes(overwrite_page(written.read_bytes(), page_of(written, "runs"), bytes(PAGE)))
    monkeypatch.setattr(arguments, "FULL_CHECK_BYTES", 0)
    arguments.require_store(f"sqlite:///{path}")  # not seen before MLflow reads
    with pytest.raises(SystemExit) as e:
        main(["--tracking-uri", f"sqlite:///{path}", *argv, *(["--out", str(tmp_path / "report")] if argv else [])])
    assert str(e.value) == f"error: the MLflow store {path} cannot be read: {MALFORMED}"


@pytest.mark.slow
def test_every_command_that_reads_a_store_says_one_line_for_a_damaged_one(damaged, tmp_path):
    """Each console script on each damaged store: exit 1, one line on stderr naming the file and the cause,
    no traceback, and the file as it was."""
    for name, (path, cause) in damaged.items():
        before = path.read_bytes()
        procs = {command: subprocess.Popen([*argv, "--tracking-uri", f"sqlite:///{path}"], cwd=tmp_path, text=True,
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                 for command, argv in COMMANDS.items()}  # at once: each spends seconds importing
        for command, proc in procs.items():
            out, err = proc.communicate(timeout=300)
            assert (proc.returncode, err.splitlines()) == (1, [err.strip()]), (name, command, err[-2000:])
            assert err.startswith(f"error: the MLflow store {path} cannot be read: {cause}"), (name, command, err)
            assert "Traceback" not in err and out == "", (name, command)
        assert path.read_bytes() == before, name


@pytest.mark.slow
def test_a_store_given_as_a_path_is_refused_in_one_line_whose_uri_runs_as_printed(tmp_path):
    """`--tracking-uri outputs/mlflow.db` (a path, not a URI) ended in MLflow's traceback about its retired file
    store: each command, and compare, says one line naming the value and the forms, with the file's own URI, and
    that URI, run as printed, reads the store."""
    write_store(tmp_path / "outputs" / "mlflow.db")
    relative = "outputs/mlflow.db"
    uri = f"sqlite:///{(tmp_path / relative).resolve()}"
    given = {command: [*argv, "--tracking-uri", relative] for command, argv in COMMANDS.items()}
    given["compare"] = [sys.executable, "-m", "gaexp.compare", relative, uri]
    procs = {command: subprocess.Popen(argv, cwd=tmp_path, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for command, argv in given.items()}
    for command, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert (proc.returncode, err.strip(), out) == (
            1, f"error: {relative!r} is not a store's URI; valid: {arguments.STORE_FORMS} (this file's: {uri})", ""), command
    status = subprocess.run([*COMMANDS["gaexp-status"], "--tracking-uri", uri], cwd=tmp_path, text=True,
                            capture_output=True, timeout=300)
    assert status.returncode == 0 and "6 finished" in status.stdout, (status.stdout, status.stderr)
    with pytest.raises(SystemExit, match=re.escape("'nothere.db' is not a store's URI; valid: ") + ".*HOST:PORT$"):
        arguments.require_store("nothere.db")  # no such file: no URI to suggest


def test_a_store_printed_masked_in_a_hint_connects_as_printed():
    """A report's rerun hint names the store as gaexp prints it, `http://user:***@host`: the store argument leaves
    the masked password out, for the MLflow client to take from MLFLOW_TRACKING_PASSWORD."""
    parser = argparse.ArgumentParser()
    arguments.add_store_arguments(parser)
    assert parser.parse_args(["--tracking-uri", "http://bob:***@127.0.0.1:5000"]).tracking_uri == "http://bob@127.0.0.1:5000"
    assert parser.parse_args(["--tracking-uri", "https://***@mlflow.lab"]).tracking_uri == "https://mlflow.lab"
    assert parser.parse_args([]).tracking_uri == arguments.default_store()
