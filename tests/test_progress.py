"""Sweep progress: the cost model, the accounting and ETA (pure), and gaexp-status on a real store."""

from __future__ import annotations

import io
import time

import pytest
from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient

from gaexp import progress, tracking
from gaexp.progress import Cell, Plan

PROTOCOL = dict(num_iterations=3600, eval_period=300)


def test_expected_seconds_orders_the_study_regimes_as_the_measured_grid():
    cost = {name: progress.expected_seconds(b, k, **PROTOCOL) for name, (b, k) in
            {"bs1a16": (1, 16), "bs4a4": (4, 4), "bs16a1": (16, 1), "bs1a1": (1, 1)}.items()}
    assert list(cost) == sorted(cost, key=cost.get, reverse=True)
    # the full grid's per-cell means (docs/results.md): 190, 135, 97, 48 s; within 15%
    for name, measured in {"bs1a16": 190, "bs4a4": 135, "bs16a1": 97, "bs1a1": 48}.items():
        assert cost[name] == pytest.approx(measured, rel=0.15)
    assert progress.expected_seconds(1, 1, 10, 3) - progress.expected_seconds(1, 1, 10, 5) == pytest.approx(
        2 * 10_000 * progress.EVAL_IMAGE_S)  # 4 evaluations (3, 6, 9, 10) against 2


def cell(name: str, status: str, expected: float, elapsed: float, step: int = 0) -> Cell:
    return Cell(name, status, expected, elapsed, step, 100)


def test_snapshot_counts_every_state_and_the_work_done():
    plan = Plan(cells=8, expected_s=800, cells_at_once=2, started=1000)
    cells = [cell("a", "FINISHED", 200, 100), cell("b", "FAILED", 100, 50), cell("c", "SKIPPED", 100, 0),
             cell("d", "KILLED", 100, 10), cell("e", "RUNNING", 100, 20)]
    s = progress.snapshot(plan, cells, failed_unrecorded=1, now=1300)
    assert s.counts == {"finished": 1, "failed": 2, "killed": 1, "skipped": 1, "running": 1, "waiting": 2}
    assert s.speed == pytest.approx(300 / 150)  # the ended cells ran 2x the model's speed
    # done: 200 + 100 + 100 + 100 (ended), 100 (the failure without a run: the mean cell), 40 (running 20 s at 2x)
    assert s.done_s == pytest.approx(640)
    assert s.elapsed_s == 300
    # waiting: 800 - 600 (seen) - 100 (unrecorded failure) = 100 expected s = 50 s at 2x; running: 30 s left
    assert s.eta_s == pytest.approx((50 + 30) / 2)
    line = progress.summary_line(s)
    assert line.startswith("5/8 cells: 1 finished, 2 failed, 1 killed, 1 skipped, 1 running, 2 waiting; 80% of the work")
    assert line.endswith("elapsed 5m00s, ETA 0m40s")


def test_eta_is_never_shorter_than_the_longest_running_cell():
    plan = Plan(cells=3, expected_s=300, cells_at_once=4, started=0)
    s = progress.snapshot(plan, [cell("a", "RUNNING", 200, 20), cell("b", "RUNNING", 50, 10)], now=30)
    assert s.speed == 1.0  # nothing ended yet: the model's rates
    assert s.eta_s == 180  # the 200 s cell has 180 s left; (50 + 180 + 40) / 4 would say less


def test_eta_uses_the_cells_seen_running_at_once_when_the_launcher_did_not_say():
    plan = Plan(cells=4, expected_s=400, cells_at_once=None, started=0)
    cells = [cell("a", "FINISHED", 100, 100), cell("b", "FINISHED", 100, 100)]
    assert progress.snapshot(plan, cells, now=100).eta_s == 200  # one at a time
    assert progress.snapshot(plan, cells, now=100, observed_at_once=2).eta_s == 100


def test_without_a_plan_it_counts_what_it_sees_and_gives_no_eta():
    s = progress.snapshot(Plan(None, None, None), [cell("a", "FINISHED", 100, 80), cell("b", "RUNNING", 100, 5)])
    assert s.total is None and s.eta_s is None and s.counts["waiting"] == 0
    assert progress.summary_line(s) == "1/? cells: 1 finished, 1 running; elapsed ?, ETA ?"


# --- on a real store ----------------------------------------------------------------------------------------

SWEEP = "2026-11-30_10-00-00"


def cell_run(client: MlflowClient, experiment_id: str, name: str, status: str, sweep_id: str = SWEEP,
             evals: tuple[tuple[int, float], ...] = (), b: int = 1, k: int = 16, heartbeat: float | None = None,
             elapsed: float = 100) -> str:
    """A run as a gaexp cell records it: its tags, the protocol params, evaluations, a status, `elapsed`
    seconds from its start to now (its end, if it ended)."""
    norm, regime, seed = name.split("-")
    tags = {"norm": norm, "regime": regime, "seed": seed[1:], "batch_size": b, "num_accum": k,
            "sweep_id": sweep_id, tracking.SWEEPS: sweep_id,
            tracking.HEARTBEAT: f"{heartbeat if heartbeat is not None else time.time():.0f}"}
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


@pytest.fixture
def store(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    experiment_id = tracking.prepare_store(uri, "gaexp", str(tmp_path / "artifacts"))
    client = MlflowClient(uri)
    plan = tracking.tracked_run(client, experiment_id, f"sweep-{SWEEP}", {
        "gaexp.role": progress.ROLE, "sweep_id": SWEEP, "gaexp.cells": 4,
        "gaexp.expected_s": f"{4 * progress.expected_seconds(1, 16, **PROTOCOL):.0f}", "gaexp.cells_at_once": 2})
    plan_id = plan.__enter__()  # a sweep still running
    cell_run(client, experiment_id, "bn-bs1a16-s1", "FINISHED", evals=((300, 0.9), (3600, 0.98)))
    cell_run(client, experiment_id, "in-bs1a16-s1", "RUNNING", evals=((300, 0.91), (600, 0.95)), elapsed=1000)
    cell_run(client, experiment_id, "gn4-bs1a16-s1", "KILLED", evals=((300, 0.9),), heartbeat=time.time() - 7200)
    yield uri, client, experiment_id, plan_id
    plan.__exit__(None, None, None)


def test_read_maps_runs_to_cells_and_skipped_runs_count_in_a_later_sweep(store):
    uri, client, experiment_id, _ = store
    plan, cells = progress.read(client, experiment_id, SWEEP)
    assert (plan.cells, plan.cells_at_once) == (4, 2) and plan.ended is None
    by_name = {c.name: c for c in cells}
    assert {n: c.status for n, c in by_name.items()} == {
        "bn-bs1a16-s1": "FINISHED", "in-bs1a16-s1": "RUNNING", "gn4-bs1a16-s1": "KILLED"}
    running = by_name["in-bs1a16-s1"]
    assert (running.step, running.steps, running.valid_acc) == (600, 3600, 0.95)
    assert by_name["bn-bs1a16-s1"].valid_acc == 0.98
    assert running.expected_s == pytest.approx(progress.expected_seconds(1, 16, **PROTOCOL))
    finished = client.search_runs([experiment_id], "attributes.run_name = 'bn-bs1a16-s1'")[0]
    tracking.add_to_sweep(client, finished, "2026-12-01_09-00-00")  # a resume that skipped it
    _, later = progress.read(client, experiment_id, "2026-12-01_09-00-00")
    assert [(c.name, c.status) for c in later] == [("bn-bs1a16-s1", "SKIPPED")]


def test_status_shows_the_running_cell_with_its_step_and_accuracy_and_the_killed_one(store, capsys):
    uri, *_ = store
    progress.main(["--tracking-uri", uri])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"sweep {SWEEP} (RUNNING)"
    assert out[1].startswith("  2/4 cells: 1 finished, 1 killed, 1 running, 1 waiting; ")
    assert "ETA" in out[1] and "ETA ?" not in out[1]
    assert out[2].split()[:6] == ["in-bs1a16-s1", "step", "600/3600", "valid_acc", "0.9500", "running"]
    assert out[3].split() == ["gn4-bs1a16-s1", "KILLED", "after", "step", "300/3600"]
    assert len(out) == 4


def test_status_flags_a_running_cell_whose_heartbeat_stopped(store, capsys):
    uri, client, experiment_id, _ = store
    cell_run(client, experiment_id, "none-bs1a16-s1", "RUNNING", heartbeat=time.time() - 7200)
    progress.main(["--tracking-uri", uri, "--stale-after-s", "3600"])
    line = next(l for l in capsys.readouterr().out.splitlines() if "none-bs1a16-s1" in l)
    assert "no heartbeat for 2h00m" in line


def test_status_without_a_plan_run_counts_the_cells_of_the_newest_sweep(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    experiment_id = tracking.prepare_store(uri, "gaexp", str(tmp_path / "artifacts"))
    client = MlflowClient(uri)
    cell_run(client, experiment_id, "bn-bs16a1-s1", "FINISHED", sweep_id="old", evals=((4, 0.5),))
    cell_run(client, experiment_id, "bn-bs16a1-s2", "FINISHED", sweep_id="new", evals=((4, 0.6),))
    progress.main(["--tracking-uri", uri])
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == ["sweep new (no plan recorded: cells so far)", out[1]]
    assert out[1].startswith("  1/? cells: 1 finished, 0 running; elapsed ")
    progress.main(["--tracking-uri", uri, "--sweep", "all"])
    assert [l for l in capsys.readouterr().out.splitlines() if l.startswith("sweep")] == [
        "sweep new (no plan recorded: cells so far)", "sweep old (no plan recorded: cells so far)"]


@pytest.mark.parametrize("argv, message", [
    (["--sweep", "nope"], "error: no sweep 'nope' in this experiment"),
    (["--experiment", "other"], "error: no experiment 'other' in "),
    (["--watch", "-1"], "error: --watch -1.0; valid: 0 (once) or a number of seconds > 0"),
])
def test_status_bad_input_is_one_line_naming_it(store, argv, message):
    uri, *_ = store
    with pytest.raises(SystemExit) as e:
        progress.main(["--tracking-uri", uri, *argv])
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_status_on_a_missing_store_or_another_scheme(tmp_path):
    with pytest.raises(SystemExit, match="no MLflow store at sqlite:///"):
        progress.main(["--tracking-uri", f"sqlite:///{tmp_path / 'none.db'}"])
    with pytest.raises(SystemExit, match=r"--tracking-uri 'file:///x'; valid: sqlite:///"):
        progress.main(["--tracking-uri", "file:///x"])


def test_live_prints_a_line_per_ended_cell_with_the_totals_and_beats_for_the_plan_run(store, tmp_path):
    uri, client, experiment_id, plan_id = store
    plan = progress.plan_of(client.get_run(plan_id))
    out = io.StringIO()
    live = progress.Live(uri, experiment_id, SWEEP, plan, tmp_path, plan_id, every=60, bar=False, out=out,
                         clock=lambda: plan.started + 5)  # 5 s into the sweep, however long the test took
    with live:
        pass  # entering and leaving polls once: the state so far
    lines = out.getvalue().splitlines()
    assert [l.split()[:2] for l in lines] == [["bn-bs1a16-s1", "FINISHED"], ["gn4-bs1a16-s1", "KILLED"]]
    assert lines[0].split(" | ")[1].startswith("2/4 cells: 1 finished, 1 killed, 1 running, 1 waiting")
    assert "valid_acc 0.9800" in lines[0]
    (tmp_path / "norm=none").mkdir()
    (tmp_path / "norm=none" / "FAILED.txt").write_text("ValueError: before its run")  # failed before a run
    snap = live.poll()
    assert snap.counts["failed"] == 1 and snap.counts["waiting"] == 0
    assert out.getvalue().count("\n") == 2  # no cell ended since: nothing printed again
    assert client.get_run(plan_id).data.tags[tracking.HEARTBEAT] == f"{plan.started + 5:.0f}"  # the sweep is alive
    assert lines[0].endswith("elapsed 0m05s, ETA 0m50s")


def test_live_on_a_terminal_draws_one_bar_over_the_work(store, tmp_path, capsys):
    uri, client, experiment_id, plan_id = store
    plan = progress.plan_of(client.get_run(plan_id))
    with progress.Live(uri, experiment_id, SWEEP, plan, tmp_path, plan_id, every=60, bar=True,
                       clock=lambda: plan.started):  # the sweep's first instant, however loaded the machine
        pass
    err = capsys.readouterr()
    assert err.out == ""  # no per-cell lines beside the bar
    # the finished cell took 100 s for 186 expected: 1.86x; the running one, 1000 s in, counts as done; the
    # killed one too: 3 of 4 equal cells, and the waiting one's 186 s / 1.86 over 2 cells at once: 50 s
    last = err.err.rstrip().split("\r")[-1]
    assert last.startswith(" 75% |")
    assert last.endswith("| 2/4 cells: 1 finished, 1 killed, 1 running, 1 waiting; elapsed 0m00s, ETA 0m50s")


def test_live_waits_out_a_store_it_cannot_read(tmp_path):
    """A store that cannot be read (here: not a database) skips a poll; it never stops the sweep."""
    (tmp_path / "mlflow.db").write_bytes(b"not a database" * 100)
    live = progress.Live(f"sqlite:///{tmp_path}/mlflow.db", "1", SWEEP, Plan(1, 10.0, 1, 0), tmp_path,
                         bar=False, out=io.StringIO())
    assert live.poll() is None
    assert (tmp_path / "mlflow.db").read_bytes() == b"not a database" * 100  # nothing written either
