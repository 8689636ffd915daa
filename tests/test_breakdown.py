"""Where a sweep's time went: the arithmetic on runs given by hand, the reader on a store written by hand (exact
times), a real tiny sweep end to end, and the one line for a sweep that is not there."""

from __future__ import annotations

import re

import pytest
from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient

from gaexp import breakdown, tracking
from gaexp import tags as runtags
from gaexp.breakdown import RunTimes

GRAPH = ("simple", "mnist", "bn", "eval")
# Plan 1000 -> 1100 s, two workers. A (pid 1, started 990, before the plan: counted from 1000) runs a1 then a2;
# B (pid 2, started 1002) runs b1, which failed. a1: cell 1005, run 1007, train start 1027 - 17 = 1010,
# evaluations at steps 2, 4, 6 at 1 s a step (6 s of training): 7, 2 and 2 s each, the first 5 s over the
# others' median; end 1029. a2: cell 1031, run 1032, one evaluation (nothing to compare: no excess), train
# start 1045 - 10 = 1035, 8 s of training, end 1047.
A1 = RunTimes("h:1", start=1007, end=1029, cell_start=1005, process_start=990, wall_seconds=17, training=6,
              evaluations=((2, 1019), (4, 1023), (6, 1027)), graph=GRAPH, name="a1")
A2 = RunTimes("h:1", start=1032, end=1047, cell_start=1031, process_start=990, wall_seconds=10, training=8,
              evaluations=((4, 1045),), graph=GRAPH, name="a2")
B1 = RunTimes("h:2", start=1012, end=1040, cell_start=1010, process_start=1002, name="b1")


def test_run_parts_make_its_cell_start_to_its_end():
    assert breakdown.run_parts(A1) == {"setup": 2, "before": 3, "training": 6, "evaluation": 6, "compilation": 5,
                                       "after": 2, "unfinished": 0}
    assert breakdown.run_parts(A2) == {"setup": 1, "before": 3, "training": 8, "evaluation": 2, "compilation": 0,
                                       "after": 2, "unfinished": 0}
    assert breakdown.run_parts(B1) == {"setup": 2, "before": 0, "training": 0, "evaluation": 0, "compilation": 0,
                                       "after": 0, "unfinished": 28}


def test_shares_of_hand_made_runs():
    b = breakdown.shares([A2, B1, A1], plan_start=1000, plan_end=1100)
    assert (b.wall, b.workers, b.cells, b.total) == (100, 2, 3, 200)
    # process: A 1005 - 1000, B 1010 - 1002; tail: A 1100 - 1047, B 1100 - 1040; between: A 1029 -> 1031,
    # B 1000 -> 1002
    assert b.seconds == {"process": 13, "setup": 5, "before": 6, "training": 14, "evaluation": 8, "compilation": 5,
                         "after": 4, "unfinished": 28, "between": 4, "tail": 113}
    assert {part: b.percent(part) for part in b.seconds} == {
        "process": 6.5, "setup": 2.5, "before": 3, "training": 7, "evaluation": 4, "compilation": 2.5, "after": 2,
        "unfinished": 14, "between": 2, "tail": 56.5}
    assert b.unknown == {}
    assert breakdown.compile_temperature([A2, B1, A1]) == ([5], [0])


def test_unknown_starts_fall_between_cells_and_a_replaced_worker_is_no_second_worker():
    # the launcher runs a1's cell itself (basic launcher): its start is no worker's; no cell_start recorded for a2,
    # run by a process that replaced the first (pid 3, started after a1 ended): one worker at a time
    a2 = RunTimes("h:3", start=1032, end=1047, process_start=1030, wall_seconds=10, training=8,
                  evaluations=((4, 1045),))
    b = breakdown.shares([A1, a2], plan_start=1000, plan_end=1050, launcher="h:1")
    assert (b.workers, b.total) == (1, 50)
    assert b.seconds == {"process": 0, "setup": 2, "before": 6, "training": 14, "evaluation": 8, "compilation": 5,
                         "after": 4, "between": 8, "tail": 3}  # between: 1000 -> 1005, 1029 -> 1032
    assert list(b.unknown) == ["process", "setup"]
    assert breakdown.shares([a2], 1000, 1050).seconds["setup"] is None


def test_the_first_evaluation_excess_counts_a_short_last_gap_by_its_steps():
    # 2 s a step; evaluations of 9, 2 and 2 s after 2, 2 and 1 steps: the last gap (4 s) is one step short
    evaluations = ((2, 113), (4, 119), (5, 123))
    assert breakdown.first_eval_excess(100, evaluations, training=10) == 7
    assert breakdown.first_eval_excess(100, evaluations[:1], training=2) == 0


def test_process_start_in_epoch_seconds_only_on_this_host_in_this_boot():
    assert breakdown.process_epoch("250", "vm", 2000, "vm", btime=1000, clk_tck=100) == 1002.5
    assert breakdown.process_epoch("250", "other", 2000, "vm", btime=1000, clk_tck=100) is None
    assert breakdown.process_epoch("250", "vm", 999, "vm", btime=1000, clk_tck=100) is None  # an earlier boot
    assert breakdown.process_epoch(None, "vm", 2000, "vm", btime=1000, clk_tck=100) is None


# --- on a real store ----------------------------------------------------------------------------------------

SWEEP = "2026-12-01_09-00-00"
T0 = 1_800_000_000  # epoch seconds: the plan's start


def hand_made_store(tmp_path) -> str:
    """The plan (T0 -> T0 + 200, run by elsewhere:9) and A1 of `test_shares_of_hand_made_runs` shifted to T0 - 1000,
    as gaexp records them, ran on another host (its process start is not known here)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    experiment_id = tracking.prepare_store(uri, "gaexp", str(tmp_path / "artifacts"))
    client = MlflowClient(uri)
    ms = lambda t: int((T0 - 1000 + t) * 1000)  # noqa: E731
    plan = client.create_run(experiment_id, start_time=ms(1000), run_name=f"sweep-{SWEEP}", tags={
        "gaexp.role": runtags.PLAN_ROLE, "sweep_id": SWEEP, runtags.HOST: "elsewhere:9"}).info.run_id
    client.set_terminated(plan, "FINISHED", end_time=ms(1200))
    tags = {"norm": "bn", "regime": "bs4a4", "batch_size": "4", "num_accum": "4", "sweep_id": SWEEP,
            runtags.SWEEPS: SWEEP, "compiled": "eval", runtags.HOST: "elsewhere:1", runtags.PROCESS_START: "99",
            runtags.CELL_START: f"{T0 - 1000 + 1005:.3f}"}
    run = client.create_run(experiment_id, start_time=ms(1007), run_name="bn-bs4a4-s1", tags=tags).info.run_id
    client.log_batch(run, params=[Param("train.num_iterations", "6"), Param("train.eval_period", "2")])
    client.log_batch(run, metrics=[Metric("valid_acc", 0.5, ms(t), step) for step, t in A1.evaluations])
    client.log_batch(run, metrics=[Metric("wall_seconds", 17, ms(1027), 6),
                                   Metric("samples_per_sec", 6 * 16 / 6, ms(1027), 6)])
    client.set_terminated(run, "FINISHED", end_time=ms(1029))
    return uri


def table_shares(text: str) -> dict[str, float | None]:
    """The printed table's shares by row label (None: n/a), total left out."""
    rows = re.findall(r"^\| (.+?) \| (\S+) \| (\S+) \|$", text, re.M)
    return {label.rstrip(" *"): None if share == "n/a" else float(share.rstrip("%"))
            for label, _, share in rows if label not in ("part", "total")}


def test_the_store_read_gives_the_hand_made_numbers(tmp_path, capsys):
    uri = hand_made_store(tmp_path)
    breakdown.main(["--tracking-uri", uri])  # latest: the only sweep
    out = capsys.readouterr().out
    assert out.startswith(f"sweep {SWEEP}: wall 3m20s (200.0 s), 1 cells, 1 workers (200.0 worker-seconds)\n")
    assert table_shares(out) == {"process start and imports": None, "setup: checks, data, model": 1,  # % of 200 s
                                 "logging before training": 1.5, "training": 3, "evaluation": 3,
                                 "compilation (first evaluation's excess)": 2.5,
                                 "logging after training (summary, model)": 1,
                                 "between cells (launcher, idle)": 2.5, "tail (a worker with nothing left)": 85.5}
    assert "5.0 s mean over the first cell of each of 1 graphs (norm, compiled), no later cells" in out


def test_an_unknown_sweep_is_one_line_naming_the_sweeps_there(tmp_path):
    uri = hand_made_store(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        breakdown.main(["--tracking-uri", uri, "--sweep", "2026-01-01_00-00-00"])
    assert exit_.value.code == f"error: no grid sweep '2026-01-01_00-00-00' in experiment 'gaexp'; there: {SWEEP}"


@pytest.mark.slow
def test_a_real_tiny_sweep_shares_its_time_out_whole(tmp_path, gaexp_command, capsys):
    proc = gaexp_command(tmp_path, "norm=gn4,bn", "regime=bs4a4", "launch=joblib", "hydra.launcher.n_jobs=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    breakdown.main(["--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"])
    out = capsys.readouterr().out
    assert re.match(r"sweep \S+: wall \S+ \([\d.]+ s\), 2 cells, 2 workers", out), out
    found = table_shares(out)
    assert len(found) == 9 and None not in found.values(), out  # this host: every worker's start is known
    assert all(share >= 0 for share in found.values()), out
    assert sum(found.values()) == pytest.approx(100, abs=0.5), out
