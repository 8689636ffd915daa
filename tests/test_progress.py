"""Sweep progress: the cost model, the accounting and ETA (pure), and gaexp-status on a real store."""

from __future__ import annotations

import dataclasses
import io
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from mlflow.tracking import MlflowClient

from gaexp import progress, tracking
from gaexp import tags as runtags
from gaexp.config import CONFIG_DIR
from gaexp.hooks import EvalPoint, Progress
from gaexp.progress import Cell, Plan
from hydra_plugins.gaexp_optuna_sweeper import tally
from hydra_plugins.gaexp_optuna_sweeper.trials import open_storage
from tests.conftest import CELL_SWEEP, cell_run

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


def test_a_data_parallel_cell_costs_the_cores_of_its_accumulation_twin():
    """w replicas of k micro-batches of b: the core-seconds of accumulation at (b, w*k), in the plan and the ETA."""
    params = {"train.num_iterations": "3600", "train.eval_period": "300"}
    dp = progress.run_seconds({"batch_size": "4", "num_accum": "2", "replicas": "2"}, params)
    assert dp == progress.run_seconds({"batch_size": "4", "num_accum": "4"}, params)  # a run before replicas: 1
    assert dp > progress.run_seconds({"batch_size": "4", "num_accum": "2", "replicas": "1"}, params)


def test_a_shared_run_costs_its_records_alone_and_compiles_nothing():
    """A run that records another's steps (gaexp.same_as) counts as nearly free in the ETA's fit, as in the plan:
    its cell's fixed cost, no training or evaluation, and no graph, whatever its twin compiled."""
    params = {"train.num_iterations": "3600", "train.eval_period": "300"}
    run = {"batch_size": "4", "num_accum": "4", "accumulate": "batched", "compiled": "train,eval", "model": "simple",
           "dataset": "mnist", "norm": "in"}
    assert progress.run_seconds(run, params) > 10 * progress.CELL_S and progress.run_graphs(run)
    shared = {**run, "gaexp.same_as": "0123abcd"}
    assert (progress.run_seconds(shared, params), progress.run_graphs(shared)) == (progress.CELL_S, frozenset())


def test_a_precision_costs_its_measured_factor_on_a_cpu_and_float32s_elsewhere():
    """The plan and the ETA cost a precision's training and evaluation at PRECISION_COST times float32's on a
    CPU; a run recorded before precision was a choice (no tag) costs as fp32, and so does any cell on a GPU."""
    params = {"train.num_iterations": "3600", "train.eval_period": "300"}
    run = {"batch_size": "1", "num_accum": "16", "accumulate": "loop", "device": "cpu"}
    fp32 = progress.run_seconds(run, params)
    assert fp32 == progress.run_seconds({**run, "precision": "fp32"}, params)
    for name, factor in progress.PRECISION_COST.items():
        here = progress.run_seconds({**run, "precision": name}, params)
        assert here - progress.CELL_S == pytest.approx(factor * (fp32 - progress.CELL_S)), name
        assert progress.run_seconds({**run, "precision": name, "device": "cuda"}, params) == fp32
    assert set(progress.PRECISION_COST) <= {p.stem for p in (Path(CONFIG_DIR) / "precision").glob("*.yaml")}


def cell(name: str, status: str, expected: float, elapsed: float, step: int = 0, graphs: float = 0.0,
         fresh: int = 0) -> Cell:
    return Cell(name, status, expected, elapsed, step, 100, new_graphs=graphs, fresh=fresh)


def test_fit_rates_keeps_the_models_values_until_a_cell_ends():
    assert progress.fit_rates([]) == progress.Rates(1.0, progress.GRAPH_S, progress.FRESH_S)


def test_a_short_cells_extra_seconds_go_to_compilation_and_a_long_ones_to_the_machines_speed():
    """The same first cell (one new graph, a fresh worker) at 20 and at 3,600 steps, 20 s over the model."""
    short, long = 6.9, 191.0  # expected_seconds at 20 and 3,600 steps (bs1a16)
    prior = progress.GRAPH_S + progress.FRESH_S
    at_20 = progress.fit_rates([(short, 1, 1, short + prior + 20)])
    at_3600 = progress.fit_rates([(long, 1, 1, long + prior + 20)])
    assert at_20.graph_s + at_20.fresh_s - prior > 0.75 * 20 and at_20.per < 1.35
    assert at_3600.per == pytest.approx(1 + 20 / long, abs=0.01) and at_3600.graph_s + at_3600.fresh_s < prior + 2


def test_cells_with_and_without_new_graphs_tell_speed_and_compilation_apart():
    truth = progress.Rates(per=1.3, graph_s=20.0, fresh_s=2.0)
    shapes = [(190, 0, 0), (97, 0, 0), (135, 0, 0), (6.9, 1, 1), (6.4, 1.5, 1), (6.4, 0, 0), (5.9, 1, 0), (6.4, 1.5, 0)]
    observed = [(e, n, f, truth.per * e + truth.graph_s * n + truth.fresh_s * f) for e, n, f in shapes]
    fit = progress.fit_rates(observed)
    assert fit.per == pytest.approx(1.3, rel=0.01) and fit.graph_s == pytest.approx(20, rel=0.05)
    assert fit.fresh_s == pytest.approx(2.0, abs=1.0)


def test_graphs_that_cost_nothing_here_are_zero_not_a_negative_cost():
    fit = progress.fit_rates([(10.0, 2, 0, 5.0), (10.0, 0, 0, 5.0)])  # no compiler: eager cells, half the model's time
    assert fit.graph_s == 0 and fit.per == pytest.approx(0.5, rel=0.05)


def test_snapshot_counts_every_state_and_the_work_done():
    plan = Plan(cells=8, expected_s=800, cells_at_once=2, started=1000)
    cells = [cell("a", "FINISHED", 200, 100), cell("b", "FAILED", 100, 50), cell("c", "SKIPPED", 100, 0),
             cell("d", "KILLED", 100, 10), cell("e", "RUNNING", 100, 20)]
    s = progress.snapshot(plan, cells, failed_unrecorded=1, now=1300)
    rates = progress.fit_rates([(200, 0, 0, 100)])  # only a FINISHED cell says how fast cells run
    assert rates.per == pytest.approx(0.5, rel=0.01) and s.speed == pytest.approx(1 / rates.per)
    # of the 2 waiting cells one is starting: the launcher runs 2 at once and 1 runs
    assert s.counts == {"finished": 1, "failed": 2, "killed": 1, "skipped": 1, "running": 1, "starting": 1,
                        "waiting": 1}
    # done: 200 + 100 + 100 + 100 (ended), 100 (the failure without a run: the mean cell), and the running
    # cell's part: 20 s of its 100 * per
    assert s.done_s == pytest.approx(600 + 100 * 20 / (100 * rates.per))
    assert s.elapsed_s == 300
    # waiting: 800 - 600 (seen) - 100 (unrecorded failure) = 100 expected s over 2 cells, a gap before each;
    # of the 2 workers one is free and takes both (the second as the first ends, before the running cell's
    # rest of 100 * per - 20 = 30 s is over)
    each = (100 * rates.per + 2 * progress.GAP_S) / 2
    assert 100 * rates.per - 20 > each and s.eta_s == pytest.approx(2 * each)
    line = progress.summary_line(s)
    assert line.startswith("5/8 cells: 1 finished, 2 failed, 1 killed, 1 skipped, 1 running, 1 starting, 1 waiting; "
                           "80% of the work")
    assert line.endswith(f"elapsed 5m00s, ETA {tally.duration(s.eta_s)}")


def test_the_work_left_counts_the_graphs_no_cell_has_compiled_yet():
    """Two cells ran and compiled 1 of the plan's 3 graphs' worth: the other 2 are still to come, at the
    fitted cost of a graph."""
    plan = Plan(cells=4, expected_s=4 * 50 + 3 * progress.GRAPH_S, cells_at_once=1, started=0, graphs=3)
    cells = [cell("a", "FINISHED", 50, 80, graphs=1, fresh=1), cell("b", "FINISHED", 50, 52)]
    s = progress.snapshot(plan, cells, now=132)
    rates = progress.fit_rates([(50, 1, 1, 80), (50, 0, 0, 52)])
    assert s.eta_s == pytest.approx(rates.per * 100 + rates.graph_s * 2 + 2 * progress.GAP_S)
    assert s.graph_s == rates.graph_s


def test_eta_is_never_shorter_than_the_longest_running_cell():
    plan = Plan(cells=3, expected_s=300, cells_at_once=4, started=0)
    s = progress.snapshot(plan, [cell("a", "RUNNING", 200, 20), cell("b", "RUNNING", 50, 10)], now=30)
    assert s.speed == 1.0  # nothing ended yet: the model's rates
    assert s.eta_s == 180  # the 200 s cell has 180 s left; (50 + 180 + 40) / 4 would say less


def test_a_running_cell_past_its_expected_time_makes_the_eta_grow_not_stick():
    """No cell ended, the first is slower than the model: the ETA must not stay at what the model said."""
    plan = Plan(cells=3, expected_s=3 * 10, cells_at_once=1, started=0)
    etas = [progress.snapshot(plan, [cell("a", "RUNNING", 10, t)], now=t).eta_s for t in (5, 30, 60)]
    assert etas[0] == pytest.approx(5 + 20 + 2 * progress.GAP_S)  # the model's guess
    assert etas[2] > etas[1] > etas[0]  # the two waiting cells are as slow as this one is so far
    assert etas[2] > 3 * etas[0]


def test_eta_uses_the_cells_seen_running_at_once_when_the_launcher_did_not_say():
    plan = Plan(cells=4, expected_s=400, cells_at_once=None, started=0)
    cells = [cell("a", "FINISHED", 100, 100), cell("b", "FINISHED", 100, 100)]
    assert progress.snapshot(plan, cells, now=100).eta_s == pytest.approx(200 + 2 * progress.GAP_S)  # one at a time
    assert progress.snapshot(plan, cells, now=100, observed_at_once=2).eta_s == pytest.approx(100 + progress.GAP_S)


def test_without_a_plan_it_counts_what_it_sees_and_gives_no_eta():
    s = progress.snapshot(Plan(None, None, None), [cell("a", "FINISHED", 100, 80), cell("b", "RUNNING", 100, 5)])
    assert s.total is None and s.eta_s is None and s.counts["waiting"] == 0
    assert progress.summary_line(s) == "1/? cells: 1 finished, 1 running; elapsed ?, ETA ?"


def test_a_resumed_sweep_counts_its_skipped_cells_as_done_work_and_reads_100_when_every_cell_ended():
    """The plan costs every cell, the first one's evaluation graph too; on resume 2 cells are SKIPPED (that graph
    compiled by their earlier sweep: no cell of this one compiles it, nor is a skipped cell credited with it)."""
    costs = ((50.0, 1.0), (50.0, 0.0), (50.0, 0.0), (50.0, 0.0))
    plan = Plan(cells=4, expected_s=200 + progress.GRAPH_S, cells_at_once=1, started=0, graphs=1, costs=costs)
    skipped = [cell("a", "SKIPPED", 50, 0), cell("b", "SKIPPED", 50, 0)]
    half = progress.snapshot(plan, skipped, now=10)
    assert half.share == pytest.approx(0.5)  # the 2 skipped cells' work done, the last 2 cells' left
    ended = progress.snapshot(dataclasses.replace(plan, ended=200),
                              [*skipped, cell("c", "FINISHED", 50, 60), cell("d", "FINISHED", 50, 60)], now=200)
    assert ended.done_s < ended.total_s  # the plan's graph was never compiled: work done by the plan, 96%
    assert ended.share == 1.0
    assert "4/4 cells: 2 finished, 2 skipped, 0 running; 100% of the work" in progress.summary_line(ended)


def test_free_workers_of_a_running_launcher_are_starting_cells_not_0_running():
    """The first seconds of a sweep: 2 cells at once, neither has made its run yet."""
    plan = Plan(cells=5, expected_s=500, cells_at_once=2, started=0)
    s = progress.snapshot(plan, [], now=5)
    assert (s.counts["running"], s.counts["starting"], s.counts["waiting"]) == (0, 2, 3)
    assert progress.summary_line(s).startswith("0/5 cells: 0 finished, 2 starting, 3 waiting; 0% of the work")
    one = progress.snapshot(plan, [cell("a", "RUNNING", 100, 3)], now=5)
    assert (one.counts["running"], one.counts["starting"], one.counts["waiting"]) == (1, 1, 3)
    assert s.eta_s == pytest.approx(3 * (100 + progress.GAP_S))  # all 5 cells still to run, 2 at a time
    # the launcher returned or is gone: nothing is starting
    assert progress.snapshot(dataclasses.replace(plan, ended=5), [], now=5).counts["starting"] == 0
    assert progress.snapshot(plan, [], now=5, stopped=True).counts["starting"] == 0


def test_a_stopped_sweep_has_no_eta():
    plan = Plan(cells=3, expected_s=300, cells_at_once=1, started=0, ended=150)
    s = progress.snapshot(plan, [cell("a", "FINISHED", 100, 100), cell("b", "KILLED", 100, 40)], now=400,
                          stopped=True)
    assert s.eta_s is None and s.stopped
    assert progress.summary_line(s).endswith("; elapsed 2m30s, stopped")


@pytest.mark.parametrize("status, plan_age, cell_age, stopped", [
    ("KILLED", 10, None, True),       # Ctrl-C, or marked stale by a later command
    ("FAILED", 10, None, True),
    ("RUNNING", 7200, 7200, True),    # killed outright: no heartbeat from it nor from its one RUNNING cell
    ("RUNNING", 7200, None, True),    # nor any cell running
    ("RUNNING", 7200, 30, False),     # a cell still beats: the launcher may only be quiet
    ("RUNNING", 30, None, False),     # between two cells
    ("FINISHED", 7200, None, False)])
def test_a_sweep_is_stopped_when_its_plan_run_was_killed_or_nothing_of_it_beats(status, plan_age, cell_age, stopped):
    cells = [cell("a", "FINISHED", 100, 100)]
    if cell_age is not None:
        cells.append(dataclasses.replace(cell("b", "RUNNING", 100, 50), heartbeat_age_s=cell_age))
    assert progress.sweep_stopped(status, plan_age, cells, stale_after_s=3600) is stopped


def test_graph_keys_are_shared_by_the_cells_that_share_a_graph():
    def keys(norm, b, phases=("train", "eval")):
        return progress.graph_keys(phases, "simple", "mnist", norm, b, "loop")
    assert keys("in", 1) & keys("in", 16) == {("eval", "simple", "mnist", "in")}  # evaluation: one per norm
    assert not keys("bn", 1) & keys("in", 1) and keys("bn", 1, ()) == frozenset()
    assert progress.graph_units(keys("in", 1)) == 1 + progress.TRAIN_GRAPH


# --- on a real store ----------------------------------------------------------------------------------------

SWEEP = CELL_SWEEP


@pytest.fixture
def store(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    experiment_id = tracking.prepare_store(uri, "gaexp", str(tmp_path / "artifacts"))
    client = MlflowClient(uri)
    plan = tracking.tracked_run(client, experiment_id, f"sweep-{SWEEP}", {
        "gaexp.role": runtags.PLAN_ROLE, "sweep_id": SWEEP, "gaexp.cells": 4,
        "gaexp.expected_s": f"{4 * progress.expected_seconds(1, 16, **PROTOCOL):.0f}", "gaexp.cells_at_once": 2})
    plan_id = plan.__enter__()  # a sweep still running
    cell_run(client, experiment_id, "bn-bs1a16-s1", "FINISHED", evals=((300, 0.9), (3600, 0.98)))
    cell_run(client, experiment_id, "in-bs1a16-s1", "RUNNING", evals=((300, 0.91), (600, 0.95)), elapsed=1000)
    cell_run(client, experiment_id, "gn4-bs1a16-s1", "KILLED", evals=((300, 0.9),), heartbeat=time.time() - 7200)
    yield uri, client, experiment_id, plan_id
    plan.__exit__(None, None, None)


def one_waiting_cell_s() -> float:
    """The store's ETA: the finished cell took 100 s, the running one is 1,000 s in, past what 100 s says, so
    it counts as ending now; the one waiting cell then takes a worker at the speed the two give."""
    expected = progress.expected_seconds(1, 16, **PROTOCOL)
    return progress.fit_rates([(expected, 0, 0, 100), (expected, 0, 0, 1000)]).per * expected + progress.GAP_S


def test_read_maps_runs_to_cells_and_skipped_runs_count_in_a_later_sweep(store):
    uri, client, experiment_id, _ = store
    plan, cells = progress.read(client, experiment_id, SWEEP)
    assert (plan.cells, plan.cells_at_once) == (4, 2) and plan.ended is None
    by_name = {c.name: c for c in cells}
    assert {n: c.status for n, c in by_name.items()} == {
        "bn-bs1a16-s1": "FINISHED", "in-bs1a16-s1": "RUNNING", "gn4-bs1a16-s1": "KILLED"}
    running = by_name["in-bs1a16-s1"]
    assert (running.step, running.steps, running.value) == (600, 3600, 0.95)
    assert by_name["bn-bs1a16-s1"].value == 0.98
    assert running.expected_s == pytest.approx(progress.expected_seconds(1, 16, **PROTOCOL))
    finished = client.search_runs([experiment_id], "attributes.run_name = 'bn-bs1a16-s1'")[0]
    tracking.add_to_sweep(client, finished, "2026-12-01_09-00-00")  # a resume that skipped it
    _, later = progress.read(client, experiment_id, "2026-12-01_09-00-00")
    assert [(c.name, c.status) for c in later] == [("bn-bs1a16-s1", "SKIPPED")]


def test_each_cell_is_credited_with_the_graphs_no_earlier_cell_compiled_and_its_workers_first_cell(store):
    _, client, experiment_id, _ = store
    sweep = "2026-12-02_11-00-00"
    for name, b, k, compiled, host, ago in [("in-bs1a16-s1", 1, 16, "train,eval", "h:1", 300),
                                            ("in-bs16a1-s1", 16, 1, "train,eval", "h:2", 290),
                                            ("in-bs1a16-s2", 1, 16, "train,eval", "h:1", 100),
                                            ("bn-bs1a16-s1", 1, 16, "eval", "h:2", 50)]:
        cell_run(client, experiment_id, name, "FINISHED", sweep_id=sweep, evals=((3600, 0.9),), b=b, k=k,
                 elapsed=ago, tags={"compiled": compiled, runtags.HOST: host, "model": "simple", "dataset": "mnist"})
    _, cells = progress.read(client, experiment_id, sweep)
    assert [(c.name, c.new_graphs, c.fresh) for c in cells] == [
        ("in-bs1a16-s1", 1 + progress.TRAIN_GRAPH, 1),  # in's evaluation graph and its training graph at b=1
        ("in-bs16a1-s1", progress.TRAIN_GRAPH, 1),       # evaluation's is in's again: only training's at b=16
        ("in-bs1a16-s2", 0, 0),                          # both compiled before it; its worker's second cell
        ("bn-bs1a16-s1", 1, 0)]                          # bn's evaluation graph


def test_status_shows_the_running_cell_with_its_step_and_accuracy_and_the_killed_one(store, capsys):
    uri, *_ = store
    progress.main(["--tracking-uri", uri])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"sweep {SWEEP} (RUNNING)"
    assert out[1].startswith("  2/4 cells: 1 finished, 1 killed, 1 running, 1 starting; ")  # 2 at once, 1 runs
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


def test_status_of_a_killed_sweep_says_it_stopped_and_how_to_resume_with_no_eta(store, capsys):
    uri, client, experiment_id, plan_id = store
    client.set_terminated(plan_id, "KILLED")  # Ctrl-C in the launching terminal
    client.set_terminated(client.search_runs([experiment_id], "attributes.run_name = 'in-bs1a16-s1'")[0].info.run_id,
                          "KILLED")
    text, going = progress.status_text(client, experiment_id, SWEEP)
    lines = text.splitlines()
    assert lines[0] == f"sweep {SWEEP} (KILLED)" and not going
    assert lines[1].startswith("  3/4 cells: 1 finished, 2 killed, 0 running, 1 waiting; ")  # nothing starting
    assert lines[1].endswith(", stopped") and "ETA" not in text
    assert lines[2] == progress.RESUME and "run the same command again" in lines[2]


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
    assert lines[0].split(" | ")[1].startswith("2/4 cells: 1 finished, 1 killed, 1 running, 1 starting")
    assert "valid_acc 0.9800" in lines[0]
    (tmp_path / "norm=none").mkdir()
    (tmp_path / "norm=none" / "FAILED.txt").write_text("ValueError: before its run")  # failed before a run
    snap = live.poll()
    assert snap.counts["failed"] == 1 and snap.counts["waiting"] == 0
    assert out.getvalue().count("\n") == 2  # no cell ended since: nothing printed again
    assert client.get_run(plan_id).data.tags[runtags.HEARTBEAT] == f"{plan.started + 5:.0f}"  # the sweep is alive
    assert lines[0].endswith(f"elapsed 0m05s, ETA {tally.duration(one_waiting_cell_s())}")


def test_live_on_a_terminal_draws_one_bar_over_the_work(store, tmp_path, capsys):
    uri, client, experiment_id, plan_id = store
    plan = progress.plan_of(client.get_run(plan_id))
    with progress.Live(uri, experiment_id, SWEEP, plan, tmp_path, plan_id, every=60, bar=True,
                       clock=lambda: plan.started):  # the sweep's first instant, however loaded the machine
        pass
    err = capsys.readouterr()
    assert err.out == ""  # no per-cell lines beside the bar
    # 3 of 4 equal cells done (the running one, past what the fit gives it, counts as ending now); the waiting
    # one runs on a free worker at the fitted speed
    last = err.err.rstrip().split("\r")[-1]
    assert last.startswith(" 75% |")
    assert last.endswith("| 2/4 cells: 1 finished, 1 killed, 1 running, 1 starting; elapsed 0m00s, "
                         f"ETA {tally.duration(one_waiting_cell_s())}")


def test_live_bar_of_a_resume_that_skipped_every_cell_is_full(store, tmp_path, capsys):
    """The plan counts the graph the cell compiled in its first sweep; the resume compiles nothing."""
    uri, client, experiment_id, _ = store
    resume = "2026-12-02_12-00-00"
    expected = progress.expected_seconds(1, 16, **PROTOCOL)
    plan_id = client.create_run(experiment_id, run_name=f"sweep-{resume}", tags={
        "gaexp.role": runtags.PLAN_ROLE, "sweep_id": resume, "gaexp.cells": "1", "gaexp.graphs": "1",
        "gaexp.expected_s": f"{expected + progress.GRAPH_S:.3f}", "gaexp.cells_at_once": "1"}).info.run_id
    finished = client.search_runs([experiment_id], "attributes.run_name = 'bn-bs1a16-s1'")[0]
    tracking.add_to_sweep(client, finished, resume)
    plan = progress.plan_of(client.get_run(plan_id))
    with progress.Live(uri, experiment_id, resume, plan, tmp_path, plan_id, every=60, bar=True):
        pass
    last = capsys.readouterr().err.rstrip().split("\r")[-1]
    assert last.startswith("100% |") and "1/1 cells: 0 finished, 1 skipped" in last


def test_live_waits_out_a_store_it_cannot_read(tmp_path):
    """A store that cannot be read (here: not a database) skips a poll; it never stops the sweep."""
    (tmp_path / "mlflow.db").write_bytes(b"not a database" * 100)
    live = progress.Live(f"sqlite:///{tmp_path}/mlflow.db", "1", SWEEP, Plan(1, 10.0, 1, 0), tmp_path,
                         bar=False, out=io.StringIO())
    assert live.poll() is None
    assert (tmp_path / "mlflow.db").read_bytes() == b"not a database" * 100  # nothing written either


# --- which sweep gaexp-status shows by default ---------------------------------------------------------------

GRID, SEARCH = "2026-12-01_08-00-00", "2026-12-01_09-00-00"


def add_grid(client: MlflowClient, experiment_id: str, ago: float) -> None:
    """A finished grid sweep `GRID`, started `ago` s before now: its plan run, then 2 cells."""
    plan_id = client.create_run(experiment_id, run_name=f"sweep-{GRID}", start_time=int((time.time() - ago) * 1000),
                                tags={"gaexp.role": runtags.PLAN_ROLE, "sweep_id": GRID, "gaexp.cells": "2",
                                      "gaexp.expected_s": "400", "gaexp.cells_at_once": "1"}).info.run_id
    client.set_terminated(plan_id, "FINISHED")
    for seed, after in ((1, 10), (2, 200)):
        cell_run(client, experiment_id, f"bn-bs16a1-s{seed}", "FINISHED", sweep_id=GRID, evals=((3600, 0.9),),
                 elapsed=ago - after, b=16, k=1)


def add_search(client: MlflowClient, experiment_id: str, storage: Path, ago: float) -> None:
    """A finished Optuna search `SEARCH`, started `ago` s before now, as its sweeper records it: no plan run;
    in a real study storage (a journal file) its plan and 2 trials, valued 0.95 and 0.97; in MLflow a run per
    trial naming the study and its storage."""
    study = optuna.create_study(study_name="t", storage=open_storage(str(storage)), direction="maximize")
    started = time.time() - ago
    study.set_user_attr(tally.PLAN + SEARCH, {"studies": ["t"], "trials": [2], "direction": "maximize", "n_jobs": 1,
                                              "started": started, "ended": started + 100})
    for number, value in enumerate((0.95, 0.97)):
        trial = study.ask()
        trial.set_user_attr(tally.SWEEP, SEARCH)
        study.tell(trial, value)
        run_id = cell_run(client, experiment_id, f"gn4-bs16a1-s{number + 1}", "FINISHED", sweep_id=SEARCH,
                          evals=((3600, value),), elapsed=ago - 10 * number, b=16, k=1,
                          tags={"optuna.study": "t", "optuna.trial": number})
        client.log_param(run_id, "optuna.storage", str(storage))


@pytest.fixture
def grid_then_search(tmp_path):
    """A real store with a grid sweep and, started after it, an Optuna search."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    experiment_id = tracking.prepare_store(uri, "gaexp", str(tmp_path / "artifacts"))
    client = MlflowClient(uri)
    add_grid(client, experiment_id, ago=3000)
    add_search(client, experiment_id, tmp_path / "optuna.journal", ago=1000)
    return uri, client, experiment_id


def test_the_default_and_latest_sweep_is_a_newer_search_not_the_older_grid(grid_then_search, tmp_path):
    """The grid's plan run is the newest plan run, yet the search started after the grid's every run: it
    is the newest sweep, both by default (nothing running) and with --sweep latest, as gaexp-report takes it."""
    uri, *_ = grid_then_search
    procs = [subprocess.Popen([str(Path(sys.executable).parent / "gaexp-status"), "--tracking-uri", uri, *argv],
                              cwd=tmp_path, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for argv in ([], ["--sweep", "latest"])]
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        lines = out.splitlines()
        assert lines[0] == f"sweep {SEARCH} (Optuna search)"
        assert lines[1].startswith("  2/2 trials: 2 complete, 0 pruned, 0 failed, 0 running, 0 waiting; "
                                   "best 0.9700 (trial 1); elapsed 1m40s")
        assert len(lines) == 2


@pytest.mark.parametrize("wanted", ["active", "latest"])
def test_the_newest_sweep_is_the_one_that_started_last_whatever_its_kind(tmp_path, wanted):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    experiment_id = tracking.prepare_store(uri, "gaexp", str(tmp_path / "artifacts"))
    client = MlflowClient(uri)
    add_grid(client, experiment_id, ago=3000)
    assert progress.sweeps_to_show(client, experiment_id, wanted) == [GRID]
    add_search(client, experiment_id, tmp_path / "optuna.journal", ago=2000)  # a search after the grid's every run
    assert progress.sweeps_to_show(client, experiment_id, wanted) == [SEARCH]
    resume = "2026-12-01_10-00-00"  # a rerun of the grid that found every cell done: its plan run, no cell run
    plan = client.create_run(experiment_id, run_name=f"sweep-{resume}", start_time=int((time.time() - 1000) * 1000),
                             tags={"gaexp.role": runtags.PLAN_ROLE, "sweep_id": resume, "gaexp.cells": "2",
                                   "gaexp.expected_s": "400"})
    client.set_terminated(plan.info.run_id, "FINISHED")
    assert progress.sweeps_to_show(client, experiment_id, wanted) == [resume]


def test_latest_shows_the_newest_sweep_only_while_active_shows_every_running_one(store):
    """Two sweeps running at once, the store's grid and a search started after it: 'active' shows both,
    'latest' the search."""
    uri, client, experiment_id, _ = store
    later = "2026-12-02_09-00-00"
    cell_run(client, experiment_id, "none-bs1a16-s1", "RUNNING", sweep_id=later, elapsed=0,  # after the plan run
             tags={"optuna.study": "t", "optuna.trial": 0})
    assert progress.sweeps_to_show(client, experiment_id, "latest") == [later]
    assert progress.sweeps_to_show(client, experiment_id, "active") == [SWEEP, later]


# --- a single run's bar (hooks.Progress) ----------------------------------------------------------------------

@pytest.mark.parametrize("compiling_eval", [True, False])
def test_a_runs_bar_says_it_compiles_its_first_evaluation_and_no_more_after(compiling_eval, capsys):
    bar = Progress(total=10, desc="gn4-bs4a4-s1", show=True, compiling_eval=compiling_eval)
    bar.after_step(1, None)
    bar.before_eval(None, 5)
    assert (Progress.COMPILING in str(bar.bar)) is compiling_eval  # the line tqdm draws
    bar.after_eval(EvalPoint(5, 0.25, {"valid_acc": 0.875}, 123.4))
    assert Progress.COMPILING not in str(bar.bar) and "valid_acc=0.8750" in str(bar.bar)
    bar.before_eval(None, 10)  # compiled already: the second evaluation is quick
    assert Progress.COMPILING not in str(bar.bar)
    bar.close()
    assert (Progress.COMPILING in capsys.readouterr().err) is compiling_eval  # drawn on the terminal
