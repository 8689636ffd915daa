"""A store of N gaexp runs, written in seconds: for benchmarks and tests of reads at a team's scale.

`python -m gaexp.tools.storegen --store sqlite:////ABS/store.db --runs 6000` writes sweeps of the study's 60
cells (5 norms x 4 regimes x 3 seeds, each with a plan run as a grid sweep records one), until the
experiment holds at least N training runs; an existing generated store is extended. The first sweep
(`gen-000000`) is written through MLflow's client with gaexp's own tracking functions: every param of
a composed cell, its tags, 12 evaluations, the summary metrics and the curves tags, as a real cell logs
them. Every later sweep is a copy of it made in SQL on the SQLite file (new run ids, sweep id, protocol
key and start times): MLflow's client writing one run at a time takes minutes per thousand runs.
A tracking server reads such a file as its backend store (`mlflow server --backend-store-uri`).
"""

from __future__ import annotations

import argparse
import itertools
import sqlite3
import sys
import time
from pathlib import Path
from typing import Sequence

from mlflow.entities import RunStatus
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from gaexp import tracking
from gaexp.config import compose_config
from gaexp.hooks import EvalPoint
from gaexp.metrics import ACTIVATION_MB, PEAK_RSS_MB, VALID_ACC
from gaexp.study import study
from gaexp.tags import HEARTBEAT, HOST, PLAN_ROLE, PROTOCOL_KEY, ROLE, SWEEP_ID, cell_tags, plan_tags

EVALS, STEPS = study().evaluations, 3000  # evaluations a generated run logs (the study's), every STEPS / EVALS steps
SWEEP_S = 3600  # seconds between the starts of generated sweeps


def sweep_id(k: int) -> str:
    return f"gen-{k:06d}"  # zero-padded: sorts as the sweeps started, as timestamp ids do


def cells() -> list[tuple[str, str, int]]:
    grid = study()
    return list(itertools.product(grid.norms, grid.regimes, grid.seeds))


def curve(index: int) -> list[EvalPoint]:
    """A plausible learning curve, different per cell, the same on every machine."""
    top = 0.95 + 0.0004 * (index % 97)
    return [EvalPoint(step=s, valid={VALID_ACC.name: round(top * (1 - 0.5 ** (i + 1)), 6)}, train_loss=round(2.3 * 0.7 ** i, 6),
                      samples_per_sec=400.0 + index) for i, s in enumerate(range(STEPS // EVALS, STEPS + 1, STEPS // EVALS))]


def write_first_sweep(client: MlflowClient, experiment_id: str, started_ms: int) -> int:
    """The template sweep through the client: a plan run and the 60 cells as train_and_track logs them."""
    sid = sweep_id(0)
    plan = client.create_run(experiment_id, run_name=f"sweep-{sid}", start_time=started_ms, tags=plan_tags(
        sweep_id=sid, cells=len(cells()), expected_s=3600.0, cells_at_once=2, graphs=0, costs=None,
        order="longest_first")).info.run_id
    for index, (norm, regime, seed) in enumerate(cells()):
        resolved = OmegaConf.to_container(compose_config([f"norm={norm}", f"regime={regime}", f"seed={seed}",
                                                          f"train.num_iterations={STEPS}", "accumulate=loop"],
                                                         hydra=False), resolve=True)  # a loop sweep
        c = resolved["regime"]
        tags = cell_tags(dataset=resolved["data"]["dataset"], model=resolved["model"]["name"], norm=norm, regime=regime,
                         seed=seed, batch_size=c["batch_size"], num_accum=c["num_accum"], replicas=c["replicas"],
                         accumulate=resolved["accumulate"], precision=resolved["precision"]["name"],
                         setting=resolved["accumulate"], sweep_id=sid, protocol_key=tracking.protocol_key(resolved),
                         device="cpu", threads=1, compiled="off",
                         **{HOST: "storegen:1", HEARTBEAT: f"{started_ms / 1000:.0f}"})
        start = started_ms + 1000 * (index + 1)
        run_id = client.create_run(experiment_id, run_name=f"{norm}-{regime}-s{seed}", start_time=start,
                                   tags=tags).info.run_id
        tracking.log_params(client, run_id, resolved)
        history = curve(index)
        for point in history:
            tracking.log_eval_point(client, run_id, point)
        tracking.log_summary(client, run_id, history, 60.0, {ACTIVATION_MB.name: 1.0 + index,
                                                                  PEAK_RSS_MB.name: 900.0})
        client.set_terminated(run_id, RunStatus.to_string(RunStatus.FINISHED), end_time=start + 60_000)
    client.set_terminated(plan, RunStatus.to_string(RunStatus.FINISHED), end_time=started_ms + 3_600_000)
    return len(cells())


def copy_sweeps(db: Path, experiment_id: str, first: int, count: int) -> None:
    """Sweeps `first` .. `first + count - 1` as copies of sweep 0, in SQL: new run ids, sweep ids, protocol
    keys (one protocol per sweep, as sweeps of other budgets or data have) and start times."""
    con = sqlite3.connect(db)
    try:
        template = [r for r, in con.execute(
            "SELECT DISTINCT run_uuid FROM tags WHERE key = ? AND value = ?", (SWEEP_ID, sweep_id(0)))]
        con.execute("CREATE TEMP TABLE copies (old TEXT, new TEXT, k INTEGER, sid TEXT)")
        con.executemany("INSERT INTO copies SELECT ?, lower(hex(randomblob(16))), ?, ?",
                        [(old, k, sweep_id(k)) for k in range(first, first + count) for old in template])
        offset = f"(c.k * {SWEEP_S * 1000})"
        con.execute(f"""INSERT INTO runs (run_uuid, name, source_type, source_name, entry_point_name, user_id, status,
            start_time, end_time, source_version, lifecycle_stage, artifact_uri, experiment_id, deleted_time)
            SELECT c.new, replace(r.name, '{sweep_id(0)}', c.sid), r.source_type, r.source_name, r.entry_point_name,
            r.user_id, r.status, r.start_time + {offset}, r.end_time + {offset}, r.source_version, r.lifecycle_stage,
            replace(r.artifact_uri, r.run_uuid, c.new), r.experiment_id, r.deleted_time
            FROM runs r JOIN copies c ON r.run_uuid = c.old""")
        con.execute(f"""INSERT INTO tags (key, value, run_uuid) SELECT t.key,
            CASE WHEN t.value = '{sweep_id(0)}' THEN c.sid
                 WHEN t.key = '{PROTOCOL_KEY}' THEN substr(t.value, 1, 10) || printf('%06x', c.k)
                 WHEN t.key = 'mlflow.runName' THEN replace(t.value, '{sweep_id(0)}', c.sid)
                 ELSE t.value END, c.new
            FROM tags t JOIN copies c ON t.run_uuid = c.old""")
        con.execute("INSERT INTO params (key, value, run_uuid) SELECT p.key, p.value, c.new "
                    "FROM params p JOIN copies c ON p.run_uuid = c.old")
        con.execute(f"""INSERT INTO metrics (key, value, timestamp, run_uuid, step, is_nan)
            SELECT m.key, m.value, m.timestamp + {offset}, c.new, m.step, m.is_nan
            FROM metrics m JOIN copies c ON m.run_uuid = c.old""")
        con.execute(f"""INSERT INTO latest_metrics (key, value, timestamp, step, is_nan, run_uuid)
            SELECT m.key, m.value, m.timestamp + {offset}, m.step, m.is_nan, c.new
            FROM latest_metrics m JOIN copies c ON m.run_uuid = c.old""")
        con.commit()
    finally:
        con.close()


def generated_sweeps(db: Path) -> int:
    con = sqlite3.connect(db)
    try:
        return con.execute("SELECT count(*) FROM tags WHERE key = ? AND value = ? "
                           "AND run_uuid IN (SELECT run_uuid FROM tags WHERE key = ? AND value LIKE 'gen-%')",
                           (ROLE, PLAN_ROLE, SWEEP_ID)).fetchone()[0]
    finally:
        con.close()


def generate(store: str, runs: int, experiment: str = "gaexp") -> int:
    """Extend the generated store at `store` (sqlite:///ABS.db) to at least `runs` training runs in sweeps of
    60; returns the number of sweeps it holds."""
    if not store.startswith("sqlite:///"):
        raise ValueError(f"--store {store!r}; valid: sqlite:///ABSOLUTE/PATH.db (copies are made in its SQL)")
    db = Path(store.removeprefix("sqlite:///"))
    db.parent.mkdir(parents=True, exist_ok=True)
    experiment_id = tracking.prepare_store(store, experiment, str(db.parent / "mlartifacts"))
    wanted = -(-runs // len(cells()))
    have = generated_sweeps(db)
    if have == 0:
        write_first_sweep(MlflowClient(store), experiment_id, int(time.time() * 1000) - wanted * SWEEP_S * 1000)
        have = 1
    if wanted > have:
        copy_sweeps(db, experiment_id, have, wanted - have)
    return max(have, wanted)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gaexp.tools.storegen", description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", required=True, help="sqlite:///ABSOLUTE/PATH.db (made, or extended)")
    parser.add_argument("--runs", type=int, required=True, help="training runs the store holds at least")
    parser.add_argument("--experiment", default="gaexp", help="experiment name (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        sys.exit(f"error: --runs {args.runs}; valid: an integer >= 1")
    tic = time.perf_counter()
    try:
        sweeps = generate(args.store, args.runs, args.experiment)
    except ValueError as e:
        sys.exit(f"error: {e}")
    print(f"{args.store}: {sweeps} sweeps, {sweeps * len(cells())} training runs "
          f"(+{sweeps} plan runs) in {time.perf_counter() - tic:.1f} s")


if __name__ == "__main__":
    main()
