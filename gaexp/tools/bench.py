"""Benchmark: every norm's training and evaluation rates, eager beside compiled, the loop beside the batched
engine, and the grid they add up to.

For each norm and regime, gaexp's training step (`accumulate` and Adam, as `train` runs them) is timed
with compile=off (eager: the reference arithmetic), with the `--compile` choice (default auto, what a
sweep runs), and with that choice under accumulate=batched (one pass over the b*k samples of a step,
gaexp/batched.py), interleaved, several times; the medians are reported. Evaluation likewise, per norm
(the same for both engines). Each compiled measurement starts as a cell does, with no graphs in memory, so
its first step or pass is the per-cell compile cost (graphs come from Inductor's on-disk cache once a
first cell made them); it is reported apart and added per cell. The grid estimate sums, over the norms,
regimes and 3 seeds, each cell's training at its measured rate, its 12 evaluations of 10,000 images and
that compile cost, and divides by the cells run at once. Process start and MLflow logging are left out:
compare the estimate with a real grid (docs/results.md). The `auto` column is the engine gaexp's default,
accumulate=auto, takes for the norm and regime (gaexp/engine.py; memory not considered), and the estimate's
`auto h` the grid under it. `--naive` adds the usual tutorial loop
(DataLoader, `.item()` every micro-step, NCHW, evaluation in batches of 32) as another side.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch.utils.data import DataLoader, Subset
from torchvision.transforms import ToTensor

from gaexp import engine
from gaexp.data.batches import Split, micro_batches
from gaexp.config import COMPILE_CHOICES, CONFIG_DIR, DEVICES, DataConfig, NormConfig, regime_name
from gaexp.data.catalog import DataError, data_config, image_names
from gaexp.data.dataset import fetch, open_dataset, splits
from gaexp.data.idx import torchvision_class
from gaexp.model import load
from gaexp.norms import NORMS, norm_layer
from gaexp.study import study
from gaexp.train import compile_phases, evaluate, resolve_device, step_function

STUDY = study()  # the study file's grid at its full protocol
OPTIONLESS_NORMS = tuple(name for name, norm in NORMS.items() if norm.options is NormConfig)  # built without options


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def models() -> list[str]:
    """The models of conf/model/ that name their target (custom needs one given)."""
    return sorted(p.stem for p in (Path(CONFIG_DIR) / "model").glob("*.yaml")
                  if "???" not in p.read_text() and OmegaConf.load(p).get("task", "classify") == "classify")


def build(model: str, norm: str, in_channels: int, num_classes: int) -> torch.nn.Module:
    """conf/model/<model>.yaml's network with `norm`, as a cell builds it for the dataset's channels and classes."""
    target = OmegaConf.load(Path(CONFIG_DIR) / "model" / f"{model}.yaml").target
    return load(target)(norm_layer=norm_layer(norm), in_channels=in_channels, num_classes=num_classes)


def _built(data: Split, model: str, norm: str) -> torch.nn.Module:
    return build(model, norm, data.images.shape[1], int(data.labels.max()) + 1)


def model_and_forward(data: Split, model_name: str, norm: str, device: torch.device,
                      compiled: bool) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The model as a cell builds it for `data`, and what runs it: the model, or its compiled graph starting, as
    `train` does, with no graphs in memory."""
    torch.manual_seed(0)
    model = _built(data, model_name, norm).to(device, memory_format=torch.channels_last)
    if not compiled:
        return model, model
    torch._dynamo.reset()
    return model, torch.compile(model, dynamic=False)


def training(data: Split, model_name: str, norm: str, b: int, k: int, samples: int, device: torch.device,
             compiled: bool, engine: str = "loop") -> tuple[float, float]:
    """(samples/s of optimizer steps after the first, compiled: seconds of the first step beyond a steady one);
    `engine`: accumulate=loop or batched."""
    model, forward = model_and_forward(data, model_name, norm, device, compiled)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    batches = micro_batches(len(data), b, 0, data.augment, device)
    gradient = step_function(engine, model, b)

    def step() -> None:
        gradient(forward, data, batches, k)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    tic = time.perf_counter()
    step()
    sync(device)
    first = time.perf_counter() - tic
    steps = max(1, samples // (b * k))
    tic = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    seconds = time.perf_counter() - tic
    return steps * b * k / seconds, max(0.0, first - seconds / steps) if compiled else 0.0


def evaluation(valid: Split, model_name: str, norm: str, images: int, device: torch.device, compiled: bool) -> tuple[float, float]:
    """(images/s of `evaluate` in batches of 256, compiled: seconds of the first pass beyond a steady one)."""
    _, forward = model_and_forward(valid, model_name, norm, device, compiled)
    split = valid.take(slice(0, images))
    tic = time.perf_counter()
    evaluate(forward, split)
    first = time.perf_counter() - tic
    tic = time.perf_counter()
    evaluate(forward, split)  # `evaluate` ends on .item(): synchronized
    seconds = time.perf_counter() - tic
    return images / seconds, max(0.0, first - seconds) if compiled else 0.0


def naive_shape(source: DataConfig) -> tuple[int, int]:
    """(channels, classes) of the dataset the naive side reads with its torchvision class (the MNIST family)."""
    return source.shape[0], source.num_classes


def naive_training(source: DataConfig, model_name: str, norm: str, b: int, k: int, samples: int,
                   device: torch.device = torch.device("cpu")) -> tuple[float, float]:
    """Samples/s of the usual loop: DataLoader + ToTensor, NCHW, each batch moved to `device`, `.item()`
    every micro-step."""
    loader = DataLoader(torchvision_class(source)(source.root, train=True, transform=ToTensor()), batch_size=b,
                        shuffle=True)
    torch.manual_seed(0)
    model = build(model_name, norm, *naive_shape(source)).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    running, micro_steps = 0.0, samples // b
    tic = time.perf_counter()
    for i, (x, y) in enumerate(loader):
        if i == micro_steps:
            break
        x, y = x.to(device), y.to(device)
        loss = F.cross_entropy(model(x), y) / k
        loss.backward()
        running += loss.item()
        if (i + 1) % k == 0:
            optimizer.step()
            optimizer.zero_grad()
    sync(device)
    return micro_steps * b / (time.perf_counter() - tic), 0.0


def naive_evaluation(source: DataConfig, model_name: str, norm: str, images: int) -> tuple[float, float]:
    """Images/s of the usual evaluation: batches of 32, NumPy argmax."""
    model = build(model_name, norm, *naive_shape(source)).eval()
    test = torchvision_class(source)(source.root, train=False, transform=ToTensor())
    loader = DataLoader(Subset(test, range(images)), batch_size=32)
    correct = 0
    tic = time.perf_counter()
    with torch.no_grad():
        for x, y in loader:
            correct += int((model(x).numpy().argmax(axis=1) == y.numpy()).sum())
    return images / (time.perf_counter() - tic), 0.0


Measure = Callable[[], tuple[float, float]]


def interleaved(repeats: int, sides: dict[str, Measure]) -> dict[str, tuple[float, float]]:
    """Median (rate, first-call overhead) per side, the sides taking turns; one warm-up round first
    (it pays one-time allocator set-up, and a cold compile cache)."""
    for measure in sides.values():
        measure()
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, measure in sides.items():
            runs[name].append(measure())
    return {name: (statistics.median(r for r, _ in v), statistics.median(o for _, o in v)) for name, v in runs.items()}


def full_cell_seconds(b: int, k: int, train_rate: float, eval_rate: float, overhead: float) -> float:
    """One cell at the full protocol: its training, its evaluations and its compile overhead."""
    return STUDY.steps * b * k / train_rate + STUDY.evaluations * STUDY.valid_images / eval_rate + overhead


def norm_grid_seconds(rates: dict[str, tuple[float, float]], jobs: int) -> float:
    """Wall seconds of one norm's cells (the study's regimes x seeds) at `jobs` cells at once, from its
    (rate, first-call overhead) per regime and for "eval"."""
    eval_rate, eval_overhead = rates["eval"]
    return len(STUDY.seeds) * sum(full_cell_seconds(b, k, rates[r][0], eval_rate, rates[r][1] + eval_overhead)
                                  for r, (b, k) in STUDY.shapes.items()) / jobs


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    parser = argparse.ArgumentParser(prog="python -m gaexp.tools.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="simple", choices=models(), help="conf/model/ (default: %(default)s)")
    parser.add_argument("--norms", default=",".join(STUDY.norms), help="comma-separated (default: %(default)s)")
    parser.add_argument("--regimes", default=",".join(STUDY.regimes),
                        help="comma-separated bs{b}a{k} names (default: the study's four)")
    parser.add_argument("--compile", default="auto", choices=COMPILE_CHOICES,
                        help="gaexp's side, as the `compile` key of a run (default: %(default)s); eager is compile=off")
    parser.add_argument("--device", default="cpu", choices=DEVICES, help="(default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, as one cell of a sweep (default: 1)")
    parser.add_argument("--jobs", type=int, default=None,
                        help="cells at once for the grid estimate (default: cores // threads)")
    parser.add_argument("--samples", type=int, default=1024, help="training samples per measurement")
    parser.add_argument("--eval-images", type=int, default=2064,
                        help="test images per evaluation measurement (default %(default)s: 8 batches of 256 and "
                             "a tail of 16, the two shapes 10,000 images give)")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per side (medians are reported)")
    parser.add_argument("--naive", action="store_true", help="add the usual tutorial loop as a third side")
    parser.add_argument("--data-root", default="outputs/data", help="data root (default: %(default)s)")
    parser.add_argument("--dataset", default="mnist", choices=image_names(), help="conf/data/ (default: %(default)s)")
    args = parser.parse_args(argv)
    args.norms, args.jobs = args.norms.split(","), args.jobs or max(1, cores // args.threads)
    for norm in args.norms:
        if norm not in OPTIONLESS_NORMS:
            parser.error(f"--norms: {norm!r}; valid: {', '.join(OPTIONLESS_NORMS)}")
    regimes = {}
    for name in args.regimes.split(","):
        try:
            b, k = (int(v) for v in name.removeprefix("bs").split("a"))
        except ValueError:
            parser.error(f"--regimes: bad regime {name!r}; valid: bs<b>a<k>, e.g. {', '.join(STUDY.regimes)}")
        regimes[regime_name(b, k)] = (b, k)
    args.regimes, args.cores = regimes, cores
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    device = resolve_device(args.device)
    try:
        source = data_config(args.dataset, args.data_root)
        if args.naive and source.kind != "idx":
            raise DataError(f"--naive reads the data with its torchvision MNIST-family class; --dataset "
                            f"{args.dataset} is data.kind={source.kind}; valid with --naive: an idx dataset")
        fetch(source)
        dataset = open_dataset(source)
    except (DataError, ValueError) as e:
        sys.exit(f"error: {e}")
    data, valid = splits(dataset, 0 if dataset.test is not None else len(dataset.train) // 6, device)
    torch.set_num_threads(args.threads)
    print(f"inputs: model {args.model}; norms {','.join(args.norms)}; regimes {','.join(args.regimes)}; device {device}, "
          f"{args.threads} thread(s); {args.samples} training samples and {args.eval_images} test images per "
          f"measurement, {args.repeats} repeats after a warm-up, medians;\n        eager (compile=off) beside "
          f"gaexp (compile={args.compile}, accumulate=loop) beside batched (compile={args.compile}, "
          f"accumulate=batched; gain: batched / gaexp; auto: what the default accumulate=auto runs);\n        torch {torch.__version__}, {args.cores} cores")

    rates: dict[str, dict[str, dict[str, tuple[float, float]]]] = {}  # norm -> regime|eval -> side -> (rate, s)
    for norm in args.norms:
        phases = compile_phases(args.compile, norm, device)
        rates[norm] = {}
        print(f"\n{norm}: compile={args.compile} compiles {' and '.join(sorted(phases, reverse=True)) or 'nothing'}")
        naive_column = f" {'naive':>9}" if args.naive else ""
        print(f"{'':8} {'eager':>9} {'gaexp':>9} {'ratio':>6} {'compile s':>9} {'batched':>9} {'gain':>6} {'auto':>7}"
              f"{naive_column}")
        for name, (b, k) in [*args.regimes.items(), ("eval", (0, 0))]:
            if name == "eval":
                measure = partial(evaluation, valid, args.model, norm, args.eval_images, device)
                naive = partial(naive_evaluation, source, args.model, norm, args.eval_images)
            else:
                measure = partial(training, data, args.model, norm, b, k, args.samples, device)
                naive = partial(naive_training, source, args.model, norm, b, k, args.samples)
            compiled = ("eval" if name == "eval" else "train") in phases
            sides = {"eager": partial(measure, compiled=False)}
            if compiled:
                sides["gaexp"] = partial(measure, compiled=True)
            if name != "eval":  # evaluation is the same for both engines
                sides["batched"] = partial(measure, compiled=compiled, engine="batched")
            if args.naive:
                sides["naive"] = naive
            measured = interleaved(args.repeats, sides)
            measured.setdefault("gaexp", measured["eager"])  # not compiled: gaexp's side is the eager loop
            measured.setdefault("batched", measured["gaexp"])
            chosen = "loop" if name == "eval" else engine.choose("auto", _built(data, args.model, norm), b, k, len(data),
                                                                 lambda _: None).engine
            measured["auto"] = measured["batched" if chosen == "batched" else "gaexp"]
            rates[norm][name] = measured
            (eager, _), (fast, overhead), (batched, _) = measured["eager"], measured["gaexp"], measured["batched"]
            print(f"{name:8} {eager:>9.0f} {fast:>9.0f} {fast / eager:>5.2f}x {overhead:>9.1f} {batched:>9.0f} "
                  f"{batched / fast:>5.2f}x {'' if name == 'eval' else chosen:>7}"
                  + (f" {measured['naive'][0]:>9.0f}" if args.naive else "")
                  + ("   images/s" if name == "eval" else "   samples/s"))

    if "none" in rates and len(args.norms) > 1:
        print("\nCost against no norm (none's rate / the norm's rate, gaexp's side; the goal is <= 1.3):")
        print(f"{'norm':8} " + " ".join(f"{n:>7}" for n in [*args.regimes, "eval"]))
        for norm in args.norms:
            print(f"{norm:8} " + " ".join(f"{rates['none'][n]['gaexp'][0] / rates[norm][n]['gaexp'][0]:>6.2f}x"
                                          for n in [*args.regimes, "eval"]))

    if set(STUDY.regimes) <= set(args.regimes):
        print(f"\nEstimated grid ({len(args.norms)} norms x {len(STUDY.regimes)} regimes x {len(STUDY.seeds)} seeds, "
              f"{STUDY.steps} steps, {STUDY.evaluations} evaluations of {STUDY.valid_images:,} images; {args.jobs} cells at once x {args.threads} thread(s); "
              "process start and logging left out):")
        print(f"{'norm':8} {'eager h':>8} {'gaexp h':>8} {'batched h':>9} {'auto h':>7}")
        totals = {"eager": 0.0, "gaexp": 0.0, "batched": 0.0, "auto": 0.0}
        for norm in args.norms:
            hours = {side: norm_grid_seconds({n: v[side] for n, v in rates[norm].items()}, args.jobs) / 3600
                     for side in totals}
            totals = {side: totals[side] + hours[side] * 3600 for side in totals}
            print(f"{norm:8} {hours['eager']:>8.2f} {hours['gaexp']:>8.2f} {hours['batched']:>9.2f} {hours['auto']:>7.2f}")
        print(f"{'total':8} {totals['eager'] / 3600:>8.2f} {totals['gaexp'] / 3600:>8.2f} {totals['batched'] / 3600:>9.2f}"
              f" {totals['auto'] / 3600:>7.2f}"
              f"   ({totals['eager'] / 60:.0f} -> {totals['gaexp'] / 60:.0f} -> {totals['batched'] / 60:.0f} min, "
              f"auto {totals['auto'] / 60:.0f} min; "
              "assumes cells scale across processes)")


if __name__ == "__main__":
    main()
