"""The check of gaexp's device path, in one command and one summary: `python -m gaexp.tools.gpucheck`.

For a person with one GPU (about 5 minutes on one): every norm and regime of the study at a short
budget under both engines (samples/s, and the ratio to the usual tutorial loop on the same device);
one cell run twice with deterministic=true and the two runs compared bit for bit (gaexp.compare); a
small grid on the device against the same grid on the CPU, cell by cell with the report's paired
verdict (equivalent within the margin: seed noise, not bit for bit, is expected); that grid again
with 1, 4 and 8 cells sharing the device at once (the wall time of each); the peak CUDA memory per
regime; and gaexp-check on the device. `--device cpu --tiny` runs the same steps on the CPU at a
budget of seconds (the test that keeps the command from rotting; there the device's grid is the CPU's, run once).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import pandas as pd
import torch
from mlflow.tracking import MlflowClient

from gaexp import analysis, compare, metrics
from gaexp.tools import bench
from gaexp.data.catalog import data_config
from gaexp.data.dataset import fetch, open_dataset, splits
from gaexp.train import resolve_device
from gaexp.tags import NORM, REGIME, SEED


@dataclass(frozen=True)
class Plan:
    """What the check runs: the full one, or `tiny` (seconds on a CPU)."""
    norms: tuple[str, ...]
    regimes: dict[str, tuple[int, int]]
    samples: int  # training samples per speed measurement
    grid_norms: str  # the small grid's overrides
    grid_regimes: str
    seeds: str
    steps: int  # the small grid's and the rerun's optimizer steps
    shares: tuple[int, ...]  # cells at once
    holdout: int = 0  # data.holdout: 0, evaluate on the test set; N, on N held-out training images
    margin: float = 0.5  # accuracy points: the report's default

    @property
    def runs(self) -> list[str]:
        """The overrides every run of the check shares."""
        return [f"train.num_iterations={self.steps}", f"train.eval_period={max(1, self.steps // 2)}",
                f"data.holdout={self.holdout}", "compile=off", "data.sources=[local]"]


FULL = Plan(bench.STUDY.norms, bench.STUDY.shapes, 2048, "bn,gn4", "bs1a16,bs4a4,bs16a1", "1,2,3", 300, (1, 4, 8))
TINY = Plan(("bn", "gn4"), {"bs4a4": (4, 4), "bs16a1": (16, 1)}, 64, "gn4", "bs4a4", "1,2", 4, (1, 2), holdout=256)


@dataclass
class Summary:
    lines: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def add(self, line: str) -> None:
        self.lines.append(line)
        print(line, flush=True)


def gaexp(out: Path, overrides: Sequence[str], timeout: int = 1800) -> float:
    """`python -m gaexp` with `overrides` writing under `out`; its wall seconds (RuntimeError with its
    output's tail if it failed)."""
    out.mkdir(parents=True, exist_ok=True)
    tic = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "gaexp", *overrides, f"paths.outputs={out}"], capture_output=True,
                          text=True, timeout=timeout, cwd=out)
    if done.returncode != 0:
        raise RuntimeError(f"gaexp {' '.join(overrides)} failed: {(done.stdout + done.stderr)[-1500:]}")
    return time.perf_counter() - tic


def speeds(plan: Plan, device: torch.device, data_root: str, summary: Summary) -> None:
    """Every norm and regime: samples/s of the loop and the batched engine (eager: what compile=off runs,
    the same on every device), and the tutorial loop on the device."""
    source = data_config("mnist", data_root)
    fetch(source)
    data, _ = splits(open_dataset(source, progress=False), 0, device)
    summary.add(f"speed, samples/s ({plan.samples} samples a measurement, eager; ratio: gaexp / the tutorial loop)")
    summary.add(f"  {'norm':6} {'regime':7} {'loop':>9} {'batched':>9} {'tutorial':>9} {'loop/tut':>8} {'batch/tut':>9}")
    for norm in plan.norms:
        for regime, (b, k) in plan.regimes.items():
            loop, _ = bench.training(data, "simple", norm, b, k, plan.samples, device, compiled=False)
            batched, _ = bench.training(data, "simple", norm, b, k, plan.samples, device, compiled=False,
                                        engine="batched")
            naive, _ = bench.naive_training(source, "simple", norm, b, k, plan.samples, device)
            summary.add(f"  {norm:6} {regime:7} {loop:>9.0f} {batched:>9.0f} {naive:>9.0f} {loop / naive:>7.2f}x "
                        f"{batched / naive:>8.2f}x")


def determinism(plan: Plan, device: str, data_root: str, work: Path, summary: Summary) -> None:
    cell = ["norm=bn", "regime=bs4a4", "seed=1", *plan.runs, f"device={device}", "deterministic=true",
            f"data.root={data_root}"]
    for name in ("a", "b"):
        gaexp(work / f"rerun-{name}", cell)
    found, _ = compare.differences(MlflowClient(f"sqlite:///{work}/rerun-a/mlflow.db"),
                                   MlflowClient(f"sqlite:///{work}/rerun-b/mlflow.db"))
    summary.add("determinism: norm=bn regime=bs4a4, deterministic=true, run twice: "
                + ("identical, bit for bit" if not found else f"{len(found)} differences: {found[0]}"))
    if found:
        summary.failures.append("two deterministic runs differ")


def grid(plan: Plan, device: str, data_root: str, out: Path, n_jobs: int) -> float:
    """The small grid, `n_jobs` cells at once: one at a time is the plain command (its cells in its own process, as
    a user runs a grid without a launcher), more through launch=joblib."""
    launch = ["launch=joblib", f"hydra.launcher.n_jobs={n_jobs}"] if n_jobs > 1 else []
    return gaexp(out, ["-m", f"norm={plan.grid_norms}", f"regime={plan.grid_regimes}", f"seed={plan.seeds}",
                       *plan.runs, f"device={device}", *launch, "threads=1", f"data.root={data_root}",
                       "~hydra.callbacks.report"])  # its figures are read here, not its report


def finals(store: Path) -> pd.Series:
    """Each run's last valid_acc (points), by norm, regime and seed."""
    collected = analysis.collect(MlflowClient(f"sqlite:///{store}/mlflow.db"), "gaexp", "all")
    return collected.data.sort_values("step").groupby([NORM, REGIME, SEED])[metrics.VALID_ACC.name].last() * 100


def against_cpu(plan: Plan, device: str, data_root: str, work: Path, summary: Summary) -> float:
    wall = grid(plan, device, data_root, work / "grid-device", 1)
    if device != "cpu":  # on the CPU (--device cpu, the tests' form) the device's grid is the CPU's: run once
        grid(plan, "cpu", data_root, work / "grid-cpu", 1)
    on, off = finals(work / "grid-device"), finals(work / ("grid-cpu" if device != "cpu" else "grid-device"))
    summary.add(f"{device} against cpu, final valid_acc (points), paired on the seeds {plan.seeds}, margin "
                f"+-{plan.margin}:")
    for (norm, regime), group in on.groupby(level=[NORM, REGIME]):
        a, b = group.droplevel([NORM, REGIME]), off.loc[norm, regime]
        verdict = analysis.paired_verdict(a, b, plan.margin)
        exact = "bit for bit" if a.equals(b) else "not bit for bit"
        summary.add(f"  {norm:6} {regime:7} {device} {a.mean():6.2f}  cpu {b.mean():6.2f}  diff {verdict['diff']:+.2f}  "
                    f"{analysis.verdict_text(verdict['verdict'], verdict['seeds_needed'])} ({exact})")
        if verdict["verdict"] in (analysis.VERDICTS[1], analysis.VERDICTS[2]):
            summary.failures.append(f"{norm} {regime}: {device} and cpu differ beyond seed noise")
    return wall


def sharing(plan: Plan, device: str, data_root: str, work: Path, first_wall: float, summary: Summary) -> None:
    walls = {1: first_wall}
    for n in plan.shares[1:]:
        walls[n] = grid(plan, device, data_root, work / f"grid-share{n}", n)
    summary.add("cells sharing the device, the small grid's wall time: "
                + ", ".join(f"{n} at once {w:.0f} s ({walls[1] / w:.2f}x)" for n, w in walls.items()))


def memory(work: Path, device: str, summary: Summary) -> None:
    collected = analysis.collect(MlflowClient(f"sqlite:///{work}/grid-device/mlflow.db"), "gaexp", "all")
    peak = metrics.CUDA_MAX_MEM_MB.name
    if peak not in collected.runs or collected.runs[peak].isna().all():
        summary.add(f"peak CUDA memory per regime: none recorded (device={device})")
        return
    peaks = collected.runs.groupby(REGIME)[peak].max()
    summary.add("peak CUDA memory per regime (MiB): " + ", ".join(f"{r} {v:.0f}" for r, v in peaks.items()))


def check_on(device: str, data_root: str, summary: Summary) -> None:
    done = subprocess.run([sys.executable, "-m", "gaexp.check", "model=simple", "norm=gn4", "--data", "mnist",
                           "--data-root", data_root, "--device", device, "--json"], capture_output=True, text=True,
                          timeout=600)
    try:
        verdict = json.loads(done.stdout).get("verdict")
    except json.JSONDecodeError:
        verdict = None
    summary.add(f"gaexp-check model=simple norm=gn4 on {device}: exit status {done.returncode}, verdict {verdict}")
    if done.returncode != 0:
        summary.failures.append(f"gaexp-check on {device} exited {done.returncode}: {done.stderr[-300:]}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gaexp.tools.gpucheck", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="the device to check (default: %(default)s)")
    parser.add_argument("--tiny", action="store_true", help="a budget of seconds: the CPU form the tests run")
    parser.add_argument("--data-root", default="outputs/data", help="where MNIST is (default: %(default)s)")
    parser.add_argument("--work", type=Path, default=None, help="folder for the runs (default: a temporary one)")
    args = parser.parse_args(argv)
    plan = TINY if args.tiny else FULL
    try:
        device = resolve_device(args.device)
    except (RuntimeError, ValueError) as e:
        sys.exit(f"error: --device {args.device}: {e}")
    data_root = str(Path(args.data_root).resolve())
    summary = Summary()
    tic = time.perf_counter()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    summary.add(f"gaexp GPU check on {device} ({name}), torch {torch.__version__}{', tiny' if args.tiny else ''}")
    with tempfile.TemporaryDirectory() as tmp:
        work = (args.work or Path(tmp)).resolve()
        speeds(plan, device, data_root, summary)
        determinism(plan, device.type, data_root, work, summary)
        wall = against_cpu(plan, device.type, data_root, work, summary)
        sharing(plan, device.type, data_root, work, wall, summary)
        memory(work, device.type, summary)
        check_on(device.type, data_root, summary)
    summary.add(f"done in {time.perf_counter() - tic:.0f} s: "
                + ("every step passed" if not summary.failures else "FAILED: " + "; ".join(summary.failures)))
    sys.exit(1 if summary.failures else 0)


if __name__ == "__main__":
    main()
