"""The launching terminal's live progress: a tqdm bar or log lines from the store while the launches run, and the
plan run's heartbeat.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Sequence, TextIO

from mlflow.tracking import MlflowClient
from tqdm import tqdm

from gaexp.progress.account import Cell, Plan, Snapshot, snapshot, summary_line
from gaexp.progress.sweep import read
from gaexp.tags import HEARTBEAT
from hydra_plugins.gaexp_optuna_sweeper.tally import duration


log = logging.getLogger(__name__)


def running_lines(cells: Sequence[Cell], stale_after_s: float = 3600) -> list[str]:
    lines = []
    for c in sorted((c for c in cells if c.status == "RUNNING"), key=lambda c: c.name):
        acc = "-" if c.value is None else f"{c.value:.4f}"
        quiet = (f"  (no heartbeat for {duration(c.heartbeat_age_s)}: its process may be gone)"
                 if c.heartbeat_age_s is not None and c.heartbeat_age_s > stale_after_s else "")
        lines.append(f"  {c.name:<20} step {c.step:>5}/{c.steps}  {c.headline} {acc}  running {duration(c.elapsed_s)}{quiet}")
    return lines


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
            if snap.left_s is not None:  # the work done and left (a resume's skipped cells: done)
                self.tqdm.total = max(1, round(snap.done_s + snap.left_s))
            self.tqdm.n = min(round(snap.done_s), self.tqdm.total)
            self.tqdm.set_description_str(summary_line(snap, work=False))  # the bar shows the work
        for cell in sorted((c for c in cells if c.status != "RUNNING" and c.name not in self.seen),
                           key=lambda c: c.name):
            self.seen.add(cell.name)
            if self.tqdm is None:
                acc = "" if cell.value is None else f", {cell.headline} {cell.value:.4f}"
                print(f"{cell.name} {cell.status} ({duration(cell.elapsed_s)}{acc}) | {summary_line(snap)}",
                      file=self.out, flush=True)
        return snap
