"""A sweep's progress, read from the tracking store: cells by state, the work left, an ETA.

Every launcher's cells write their runs to the same store, so the launching terminal (`Live`, which the
gaexp sweeper runs around its launches) and any other shell (`gaexp-status`) see the same thing. The sweeper
records its plan as a run `sweep-<id>` (tags `gaexp.cells`, `gaexp.expected_s`, `gaexp.cells_at_once`).

Cells differ by 5x in work, so progress counts work, not cells: each cell's expected seconds on one core
(`expected_seconds`, a model of the grid measured in docs/results.md), scaled by how fast this sweep's
finished cells actually went against that model.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence, TextIO

from mlflow.entities import Run
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from tqdm import tqdm

from gaexp.tracking import HEARTBEAT, SWEEPS, sweeps_of

# One core of the 2-core machine, compile=auto (the 60-cell grid, docs/results.md): a micro-batch of b
# trains forward and backward in MICRO_S * b**BATCH_EXPONENT s, Adam's step takes STEP_S, evaluation EVAL_IMAGE_S
# per image. Only ratios matter: the ETA rescales them by the cells that finished.
MICRO_S, BATCH_EXPONENT, STEP_S, EVAL_IMAGE_S = 2.6e-3, 0.7, 1.8e-3, 2.5e-4
VALID_IMAGES = 10_000  # the test set; data.holdout=N evaluates N held-out images instead
log = logging.getLogger(__name__)
ROLE = "sweep"  # gaexp.role of the run that records a sweep's plan
DONE = ("FINISHED", "FAILED", "KILLED")


def expected_seconds(batch_size: int, num_accum: int, num_iterations: int, eval_period: int,
                     valid_images: int = VALID_IMAGES, model_cost: float = 1.0) -> float:
    """A cell's expected seconds on one core of the reference machine; `model_cost` (model.cost) scales
    the simple CNN's times to another model's."""
    evaluations = num_iterations // eval_period + (num_iterations % eval_period > 0)
    step = num_accum * MICRO_S * batch_size ** BATCH_EXPONENT + STEP_S
    return model_cost * (num_iterations * step + evaluations * valid_images * EVAL_IMAGE_S)


def cell_seconds(tags: Mapping[str, str], params: Mapping[str, str]) -> float:
    """`expected_seconds` of a cell's run, from its tags and logged config."""
    return expected_seconds(int(tags["batch_size"]), int(tags["num_accum"]), int(params["train.num_iterations"]),
                            int(params["train.eval_period"]), int(params.get("data.holdout", 0)) or VALID_IMAGES,
                            float(params.get("model.cost", 1.0)))


@dataclass(frozen=True)
class Cell:
    """One run of a sweep as the store shows it."""

    name: str
    status: str  # RUNNING, FINISHED, FAILED, KILLED, or SKIPPED (FINISHED by an earlier sweep)
    expected_s: float
    elapsed_s: float  # so far (running), or start to end
    step: int = 0  # the last evaluated optimizer step
    steps: int = 0
    valid_acc: float | None = None
    heartbeat_age_s: float | None = None


@dataclass(frozen=True)
class Plan:
    cells: int | None  # None: not recorded (a sweep run by another sweeper, or a single run)
    expected_s: float | None
    cells_at_once: int | None
    started: float | None = None  # epoch seconds
    ended: float | None = None  # the plan run's end: every launch returned (or the launching process stopped)


@dataclass(frozen=True)
class Snapshot:
    counts: dict[str, int]  # finished, failed, killed, skipped, running, waiting
    total: int | None
    done_s: float  # expected seconds of work done (finished, failed, skipped, and running cells' part)
    total_s: float | None
    elapsed_s: float | None
    eta_s: float | None
    speed: float  # expected seconds per real second of one cell (1: as the model says)


def snapshot(plan: Plan, cells: Sequence[Cell], failed_unrecorded: int = 0, now: float | None = None,
             observed_at_once: int = 0) -> Snapshot:
    """Accounting of a sweep: pure, from its plan and its cells' runs. `failed_unrecorded`: cells that failed
    before creating a run (their FAILED.txt is in the sweep folder)."""
    now = time.time() if now is None else now
    counts = {k: 0 for k in ("finished", "failed", "killed", "skipped", "running", "waiting")}
    for cell in cells:
        counts[cell.status.lower()] += 1
    counts["failed"] += failed_unrecorded
    ended = [c for c in cells if c.status in ("FINISHED", "FAILED") and c.elapsed_s > 0]
    speed = sum(c.expected_s for c in ended) / sum(c.elapsed_s for c in ended) if ended else 1.0
    mean_s = (plan.expected_s / plan.cells) if plan.cells and plan.expected_s else 0.0
    done_s = sum(c.expected_s for c in cells if c.status != "RUNNING") + failed_unrecorded * mean_s
    running = [c for c in cells if c.status == "RUNNING"]
    running_left = [max(0.0, c.expected_s / speed - c.elapsed_s) for c in running]
    done_s += sum(c.expected_s - left * speed for c, left in zip(running, running_left))
    total, total_s, eta = plan.cells, plan.expected_s, None
    if total is not None:
        counts["waiting"] = max(0, total - len(cells) - failed_unrecorded)
    if total_s is not None:
        waiting_s = max(0.0, total_s - sum(c.expected_s for c in cells) - failed_unrecorded * mean_s)
        at_once = max(plan.cells_at_once or 0, observed_at_once, len(running), 1)
        eta = max([(waiting_s / speed + sum(running_left)) / at_once, *running_left])
    elapsed = None if plan.started is None else max(0.0, (plan.ended or now) - plan.started)
    return Snapshot(counts, total, done_s, total_s, elapsed, eta, speed)


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(round(seconds))
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def summary_line(s: Snapshot, work: bool = True) -> str:
    """'23/60 cells: 20 finished, 1 failed, 2 skipped, 2 running, 35 waiting; 41% of the work; elapsed 24m10s, ETA 35m'."""
    c = s.counts
    done = c["finished"] + c["failed"] + c["killed"] + c["skipped"]
    parts = [f"{c[k]} {k}" for k in ("finished", "failed", "killed", "skipped", "running", "waiting")
             if c[k] or k in ("finished", "running")]
    line = f"{done}/{s.total if s.total is not None else '?'} cells: {', '.join(parts)}"
    if s.total_s and work:
        line += f"; {100 * s.done_s / s.total_s:.0f}% of the work"
    return line + f"; elapsed {duration(s.elapsed_s)}, ETA {duration(s.eta_s)}"


# --- reading the store ----------------------------------------------------------------------------------

def sweep_runs(client: MlflowClient, experiment_id: str, sweep_id: str) -> tuple[Run | None, list[Run]]:
    """The sweep's plan run (None if not recorded) and its cells' runs (trained or skipped by it)."""
    runs = client.search_runs([experiment_id], f"tags.`{SWEEPS}` LIKE '%{sweep_id}%'", max_results=50_000)
    cells = [r for r in runs if sweep_id in sweeps_of(r) and "norm" in r.data.tags]
    plans = client.search_runs([experiment_id], f"tags.`gaexp.role` = '{ROLE}' and tags.sweep_id = '{sweep_id}'",
                               max_results=1)
    return (plans[0] if plans else None), cells


def plan_of(run: Run | None) -> Plan:
    if run is None:
        return Plan(None, None, None)
    tags = run.data.tags
    at_once = tags.get("gaexp.cells_at_once", "")
    return Plan(int(tags["gaexp.cells"]), float(tags["gaexp.expected_s"]), int(at_once) if at_once.isdigit() else None,
                run.info.start_time / 1000, run.info.end_time / 1000 if run.info.end_time else None)


def cell_of(client: MlflowClient, run: Run, sweep_id: str, now: float) -> Cell:
    info, tags, params = run.info, run.data.tags, run.data.params
    status = "SKIPPED" if tags.get("sweep_id") != sweep_id and info.status == "FINISHED" else info.status
    end = info.end_time / 1000 if info.end_time else now
    steps = int(params.get("train.num_iterations", 0))
    step, acc = steps, run.data.metrics.get("final_valid_acc")
    if status in ("RUNNING", "FAILED", "KILLED"):  # where it is, or stopped: its latest evaluation
        history = client.get_metric_history(info.run_id, "valid_acc")
        step, acc = (history[-1].step, history[-1].value) if history else (0, None)
    beat = float(tags.get(HEARTBEAT, info.start_time / 1000))
    expected = cell_seconds(tags, params) if "train.num_iterations" in params else 0.0
    return Cell(info.run_name, status, expected, max(0.0, end - info.start_time / 1000), step, steps, acc,
                now - beat)


def read(client: MlflowClient, experiment_id: str, sweep_id: str, now: float | None = None) -> tuple[Plan, list[Cell]]:
    now = time.time() if now is None else now
    plan_run, runs = sweep_runs(client, experiment_id, sweep_id)
    return plan_of(plan_run), [cell_of(client, r, sweep_id, now) for r in runs]


def running_lines(cells: Sequence[Cell], stale_after_s: float = 3600) -> list[str]:
    lines = []
    for c in sorted((c for c in cells if c.status == "RUNNING"), key=lambda c: c.name):
        acc = "-" if c.valid_acc is None else f"{c.valid_acc:.4f}"
        quiet = (f"  (no heartbeat for {duration(c.heartbeat_age_s)}: its process may be gone)"
                 if c.heartbeat_age_s is not None and c.heartbeat_age_s > stale_after_s else "")
        lines.append(f"  {c.name:<20} step {c.step:>5}/{c.steps}  valid_acc {acc}  running {duration(c.elapsed_s)}{quiet}")
    return lines


# --- live, in the launching process -----------------------------------------------------------------------

class Live:
    """Polls the store every `every` s while the launcher runs the cells: a tqdm bar over the work on a
    terminal, else a log line per ended cell with the totals. Never stops the sweep: a failed read
    (the store busy) is retried at the next poll."""

    def __init__(self, tracking_uri: str, experiment_id: str, sweep_id: str, plan: Plan, sweep_dir: Path,
                 plan_run_id: str | None = None, every: float = 10.0, bar: bool | None = None, out: TextIO | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.uri, self.experiment_id, self.sweep_id = tracking_uri, experiment_id, sweep_id
        self.client: MlflowClient | None = None  # made at the first poll, where a store that fails is waited out
        self.plan, self.sweep_dir, self.plan_run_id, self.every = plan, sweep_dir, plan_run_id, every
        self.clock = clock  # the time now, in seconds since the epoch (a test's own clock)
        self.out = out or sys.stdout  # printed, not logged: an in-process launcher's cells reconfigure logging
        self.bar = sys.stderr.isatty() if bar is None else bar
        self.seen: set[str] = set()
        self.most_running, self.last_beat = 0, 0.0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.loop, name="gaexp-progress", daemon=True)
        self.tqdm: tqdm | None = None

    def __enter__(self) -> "Live":
        if self.bar:
            self.tqdm = tqdm(total=round(self.plan.expected_s or 0), dynamic_ncols=True,
                             bar_format="{percentage:3.0f}% |{bar:16}| {desc}")
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.poll()  # the final state
        if self.tqdm is not None:
            self.tqdm.close()

    def loop(self) -> None:
        while not self.stop.wait(self.every):
            self.poll()

    def poll(self) -> Snapshot | None:
        now = self.clock()
        try:
            self.client = self.client or MlflowClient(self.uri)
            plan, cells = read(self.client, self.experiment_id, self.sweep_id, now)
            if self.plan_run_id and now - self.last_beat > 60:  # the plan run's process is alive
                self.client.set_tag(self.plan_run_id, HEARTBEAT, f"{now:.0f}")
                self.last_beat = now
        except Exception as e:  # noqa: BLE001 - a busy store, a server restarting: the progress waits, the sweep goes on
            log.debug("progress: store not read (%s)", e)
            return None
        recorded_failures = sum(c.status == "FAILED" for c in cells)
        markers = len(list(self.sweep_dir.glob("*/FAILED.txt")))
        running = sum(c.status == "RUNNING" for c in cells)
        self.most_running = max(self.most_running, running)
        snap = snapshot(self.plan, cells, max(0, markers - recorded_failures), now, self.most_running)
        if self.tqdm is not None:
            self.tqdm.n = min(round(snap.done_s), self.tqdm.total)
            self.tqdm.set_description_str(summary_line(snap, work=False))  # the bar shows the work
        for cell in sorted((c for c in cells if c.status != "RUNNING" and c.name not in self.seen),
                           key=lambda c: c.name):
            self.seen.add(cell.name)
            if self.tqdm is None:
                acc = "" if cell.valid_acc is None else f", valid_acc {cell.valid_acc:.4f}"
                print(f"{cell.name} {cell.status} ({duration(cell.elapsed_s)}{acc}) | {summary_line(snap)}",
                      file=self.out, flush=True)
        return snap


# --- gaexp-status -----------------------------------------------------------------------------------------

def sweeps_to_show(client: MlflowClient, experiment_id: str, wanted: str) -> list[str]:
    """`wanted`: 'active' (sweeps whose plan run is RUNNING, else the newest sweep), 'all', or ids, comma-separated."""
    if wanted not in ("active", "all"):
        return wanted.split(",")
    plans = client.search_runs([experiment_id], f"tags.`gaexp.role` = '{ROLE}'", order_by=["attributes.start_time DESC"],
                               max_results=50_000)
    if wanted == "all" or not plans:
        runs = client.search_runs([experiment_id], "tags.norm != ''", order_by=["attributes.start_time DESC"],
                                  max_results=50_000)
        ids = list(dict.fromkeys([p.data.tags["sweep_id"] for p in plans] + [r.data.tags.get("sweep_id", "") for r in runs]))
        return [i for i in ids if i] if wanted == "all" else ids[:1]
    active = [p.data.tags["sweep_id"] for p in plans if p.info.status == "RUNNING"]
    return active or [plans[0].data.tags["sweep_id"]]


def status_text(client: MlflowClient, experiment_id: str, sweep_id: str, stale_after_s: float = 3600,
                now: float | None = None) -> tuple[str, bool]:
    """The sweep's status block, and whether its plan run is still RUNNING."""
    now = time.time() if now is None else now
    plan_run, runs = sweep_runs(client, experiment_id, sweep_id)
    if plan_run is None and not runs:
        raise ValueError(f"no sweep {sweep_id!r} in this experiment")
    plan, cells = plan_of(plan_run), [cell_of(client, r, sweep_id, now) for r in runs]
    if plan.started is None and cells:  # no plan recorded: the sweep started with its first cell
        plan = Plan(None, None, None, min(now - c.elapsed_s for c in cells))
    snap = snapshot(plan, cells, now=now)
    state = f" ({plan_run.info.status})" if plan_run is not None else " (no plan recorded: cells so far)"
    lines = [f"sweep {sweep_id}{state}", "  " + summary_line(snap), *running_lines(cells, stale_after_s)]
    for c in sorted((c for c in cells if c.status in ("FAILED", "KILLED")), key=lambda c: c.name):
        lines.append(f"  {c.name:<20} {c.status} after step {c.step}/{c.steps}")
    return "\n".join(lines), plan_run is not None and plan_run.info.status == "RUNNING"


def main(argv: Sequence[str] | None = None) -> None:
    default_uri = "sqlite:///" + str(Path("outputs/mlflow.db").resolve())
    parser = argparse.ArgumentParser(prog="gaexp-status", description=(
        "Where gaexp sweeps stand, read from the tracking store: cells by state, the running ones, the ETA."))
    parser.add_argument("--tracking-uri", default=default_uri,
                        help="MLflow store: sqlite:///... or http://HOST:PORT (default: %(default)s)")
    parser.add_argument("--experiment", default="gaexp", help="experiment name (default: %(default)s)")
    parser.add_argument("--sweep", default="active",
                        help="'active' (sweeps still running, else the newest), 'all', or sweep ids, comma-separated "
                             "(default: %(default)s)")
    parser.add_argument("--watch", type=float, default=0, metavar="S", help="print again every S seconds until "
                        "no shown sweep is running (0: once; default: %(default)s)")
    parser.add_argument("--stale-after-s", type=float, default=3600,
                        help="flag RUNNING cells without a heartbeat this long (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.tracking_uri.startswith("sqlite:///") and not Path(args.tracking_uri.removeprefix("sqlite:///")).is_file():
        sys.exit(f"error: no MLflow store at {args.tracking_uri}")
    if not args.tracking_uri.startswith(("sqlite:///", "http://", "https://")):
        sys.exit(f"error: --tracking-uri {args.tracking_uri!r}; valid: sqlite:///ABSOLUTE/PATH.db or http(s)://HOST:PORT")
    if args.watch < 0:
        sys.exit(f"error: --watch {args.watch}; valid: 0 (once) or a number of seconds > 0")
    client = MlflowClient(args.tracking_uri)
    try:
        experiment = client.get_experiment_by_name(args.experiment)
        if experiment is None:
            names = [e.name for e in client.search_experiments()]
            sys.exit(f"error: no experiment {args.experiment!r} in {args.tracking_uri}; there: {names}")
        while True:
            shown = sweeps_to_show(client, experiment.experiment_id, args.sweep)
            if not shown:
                sys.exit(f"error: experiment {args.experiment!r} has no gaexp sweep yet")
            blocks = [status_text(client, experiment.experiment_id, s, args.stale_after_s) for s in shown]
            print("\n\n".join(text for text, _ in blocks), flush=True)
            if not args.watch or not any(running for _, running in blocks):
                return
            time.sleep(args.watch)
            print()
    except (MlflowException, ValueError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
