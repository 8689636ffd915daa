"""The drift table: how far each precision's accumulated gradient is from float64 as k grows, on gaexp's models.

    python -m gaexp.tools.drift --model simple --norm gn4 --ks 1,4,16,64,256

For each precision (float32; bf16 autocast; bf16 weights summed in bf16; bf16 weights summed in float32; fp16
autocast with a GradScaler: gaexp's precision= choices, as gaexp/precision.py computes them), one training step of
k micro-batches of b from the same weights and samples, against the same step in float64. The measurement is
gaexp-check's (`gaexp.check.precision_drift`: one function, two callers): each cell is the accumulated gradient's
relative error over all parameters, the big batch's (one batch of b*k at that precision) beside it, in bold where
gaexp-check calls accumulation measurably worse. The inputs are MNIST-shaped (1x28x28): random images, or MNIST's
training images in the seed's order; the k-th column's step takes the first b*k of them.

Then each precision's training, in a fresh process of its own (so that no precision's memory is another's):
samples/s of gaexp's training step (`train.accumulate`, the loop engine, and Adam under the precision, as a cell
runs them) over
`--steps` optimizer steps of `--time-k` micro-batches after one untimed step, and its peak memory. On a GPU,
torch's peak of allocated memory during those steps. On a CPU, torch's allocator keeps no peak and tracemalloc
does not see torch, so the process's peak resident set is read (Linux: VmHWM, reset just before the first step):
the peak, and how far it rose above the process's resident set before the first step (the model and data already
built), which is what training itself added; without a reset (not Linux), the peak since the process started.

The table prints its inputs (model, norm, b, ks, the data, the device and its threads, torch's version, the date)
and the command that makes it again, for docs/results.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import gc
import multiprocessing
import shlex
import sys
import time
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

import torch

from gaexp.tools import bench
from gaexp.data.batches import Split, micro_batch_indices, micro_batches
from gaexp.arguments import positive_ints
from gaexp.check.numerics import PrecisionDrift, dtype_name, precision_drift, summed_in
from gaexp.config import DEVICES, FP32, PrecisionConfig
from gaexp.data.catalog import DataError, data_config
from gaexp.data.dataset import open_dataset
from gaexp.memory import peak_rss_bytes, reset_peak_rss, rss_bytes
from gaexp.precision import DTYPES, Precision, cpu_has_instructions, device_problem, precision_config
from gaexp.train import accumulate, resolve_device

PRECISIONS = ("fp32", "bf16", "bf16w", "bf16w-acc32", "fp16")  # the table's rows, gaexp's precision= names
KS = (1, 4, 16, 64, 256)
SHAPE, CLASSES = (1, 28, 28), 10  # MNIST's
DATA = ("random", "mnist")
T = TypeVar("T")


def data_split(data: str, root: str, samples: int, seed: int) -> Split:
    """MNIST's training images (`mnist`), or `samples` random uint8 images and classes drawn from `seed` (`random`),
    as a cell's model sees them (/ 255, channels_last)."""
    if data == "mnist":
        return open_dataset(data_config("mnist", root)).train
    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (samples, *SHAPE), dtype=torch.uint8, generator=generator)
    return Split(images, torch.randint(0, CLASSES, (samples,), generator=generator))


def build_model(model: str, norm: str, seed: int, device: torch.device) -> torch.nn.Module:
    """conf/model/<model>.yaml's network with `norm`, initialized from `seed`, on `device`, as a cell builds it."""
    torch.manual_seed(seed)
    return bench.build(model, norm, SHAPE[0], CLASSES).to(device, memory_format=torch.channels_last).train()


def errors(model: torch.nn.Module, split: Split, b: int, ks: Sequence[int], precision: PrecisionConfig, seed: int,
           device: torch.device) -> list[PrecisionDrift]:
    """For each k: the step of k micro-batches of b (the first b*k samples of the seed's order) under `precision`
    against float64 (gaexp-check's measurement)."""
    rows = []
    for k in ks:
        index = next(micro_batch_indices(len(split), b * k, seed))
        inputs, labels = split.inputs(index).to(device), split.labels[index].to(device)
        rows.append(precision_drift(model, inputs, labels, micro_batch=b, num_accum=k, precision=precision))
    return rows


def training(model_name: str, norm: str, precision: str, b: int, k: int, steps: int, seed: int, device: str,
             data: str, root: str) -> tuple[float, int, int | None]:
    """Meant for a fresh process: `steps` optimizer steps of `k` micro-batches of `b` as a cell trains (the model
    and data in the weights' dtype, `train.accumulate`, `Precision.step` with Adam) after one untimed step:
    (samples/s, peak bytes, bytes before the first step; None where the peak could not be reset)."""
    where = torch.device(device)
    p = precision_config(precision)
    run = Precision(p, where)
    split = data_split(data, root, max(b * k, 1024), seed)
    split = dataclasses.replace(split, images=split.images.to(where), labels=split.labels.to(where),
                                dtype=DTYPES[p.weights])  # the data in the weights' dtype, as a cell has it
    model = run.prepare(build_model(model_name, norm, seed, where))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    batches = micro_batches(len(split), b, seed, device=where)

    def step() -> None:
        accumulate(model, split, batches, k, run)
        run.step(optimizer)
        optimizer.zero_grad(set_to_none=True)

    gc.collect()
    if where.type == "cuda":
        torch.cuda.synchronize(where)
        before: int | None = torch.cuda.memory_allocated(where)
        torch.cuda.reset_peak_memory_stats(where)
    else:
        before = rss_bytes() if reset_peak_rss() else None
    step()
    tic = time.perf_counter()
    for _ in range(steps):
        step()
    if where.type == "cuda":
        torch.cuda.synchronize(where)
    seconds = time.perf_counter() - tic
    peak = torch.cuda.max_memory_allocated(where) if where.type == "cuda" else peak_rss_bytes()
    return steps * b * k / seconds, peak, before


def in_fresh_process(fn: Callable[..., T], *args: object) -> T:
    """fn(*args) in a new Python process (spawned, not forked: nothing of this one's memory comes along)."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(fn, *args).result()


def label(p: PrecisionConfig) -> str:
    """A row's name: what the precision computes, and gaexp's name for it."""
    if p.weights != FP32:
        words = f"{dtype_name(p.weights)} weights, summed in {summed_in(p)}"
    else:
        words = dtype_name(FP32) if p.autocast == "none" else f"{dtype_name(p.autocast)} autocast"
    return f"{words}{', GradScaler' if p.scaler else ''} (`{p.name}`)"


def cell(d: PrecisionDrift, k: int) -> str:
    """The accumulated gradient's error (bold where measurably worse), the big batch's beside it; k=1: one number."""
    if k == 1:
        return f"{d.accumulated_rel:.2g}"
    accumulated = f"**{d.accumulated_rel:.2g}**" if d.worse else f"{d.accumulated_rel:.2g}"
    return f"{accumulated} ({d.big_rel:.2g})"


def memory_cell(peak: int, before: int | None, device: torch.device) -> str:
    mb = 2 ** 20
    if device.type == "cuda":
        return f"{peak / mb:.0f} MiB ({before / mb:.0f} before)" if before is not None else f"{peak / mb:.0f} MiB"
    return f"{peak / mb:.0f} MiB (+{max(0, peak - before) / mb:.0f})" if before is not None else f"{peak / mb:.0f} MiB"


def table(rows: Sequence[tuple[str, list[str], list[str]]], ks: Sequence[int], timed: str) -> str:
    """Markdown: one row per precision, its cells per k, then its timing and memory cells (if any)."""
    head = ["precision", *(f"k={k}" for k in ks), *([f"samples/s ({timed})", "peak memory"] if timed else [])]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join([name, *cells, *extra]) + " |" for name, cells, extra in rows]
    return "\n".join(lines)


def _ks(text: str) -> tuple[int, ...]:
    return positive_ints(text, "accumulation steps as positive integers, e.g. 1,4,16")


def _precisions(text: str) -> tuple[str, ...]:
    names = tuple(text.split(","))
    for name in names:
        try:
            precision_config(name)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return names


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        """One line, no usage: what is wrong and what is valid."""
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the options)\n")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m gaexp.tools.drift", description=(
        "The relative error against float64 of the accumulated gradient (k micro-batches of b) under each "
        "precision, for k in --ks, with the big batch's beside it, as gaexp-check --precision measures them; and "
        "each precision's training speed and peak memory, each in a fresh process. Prints a Markdown table and "
        "its inputs."))
    p.add_argument("--model", choices=bench.models(), default="simple", help=(
        "conf/model/'s network (default: %(default)s, the study's CNN)"))
    p.add_argument("--norm", choices=sorted(bench.OPTIONLESS_NORMS), default="gn4", help=(
        "its norm layer (default: %(default)s: GroupNorm couples no samples, so the accumulated and the big "
        "batch's gradients are the same step in float64 and the table measures precision alone)"))
    p.add_argument("--batch-size", type=int, default=1, help="b, the micro-batch (default: %(default)s)")
    p.add_argument("--ks", type=_ks, default=KS, help=(
        f"the accumulation steps, comma-separated (default: {','.join(map(str, KS))})"))
    p.add_argument("--precisions", type=_precisions, default=PRECISIONS, help=(
        f"the rows: gaexp's precision= names, comma-separated (default: {','.join(PRECISIONS)})"))
    p.add_argument("--data", choices=DATA, default="random", help=(
        "random uint8 images and classes from the seed, or MNIST's training images in the seed's order "
        "(default: %(default)s)"))
    p.add_argument("--data-root", default="outputs/data", help=(
        "where MNIST is, for --data mnist (default: %(default)s)"))
    p.add_argument("--device", choices=DEVICES, default="cpu", help="where the steps run (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="the weights' and the data's seed (default: %(default)s)")
    p.add_argument("--steps", type=int, default=3, help=(
        "timed optimizer steps per precision, after one untimed step (default: %(default)s; 0: no speed or "
        "memory columns, no processes started)"))
    p.add_argument("--time-k", type=int, default=16, help=(
        "micro-batches of b per timed optimizer step (default: %(default)s, the study's bs1a16)"))
    return p


def command(args: argparse.Namespace) -> str:
    """The command that makes this table again, every option written out."""
    words = ["python", "-m", "gaexp.tools.drift", "--model", args.model, "--norm", args.norm, "--batch-size",
             str(args.batch_size), "--ks", ",".join(map(str, args.ks)), "--precisions", ",".join(args.precisions),
             "--data", args.data, *(["--data-root", args.data_root] if args.data == "mnist" else []), "--device",
             args.device, "--seed", str(args.seed), "--steps", str(args.steps), "--time-k", str(args.time_k)]
    return shlex.join(words)


def inputs_line(args: argparse.Namespace, device: torch.device) -> str:
    if device.type == "cuda":
        where = f"cuda ({torch.cuda.get_device_name(device)})"
    else:
        caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
        missing = [name for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16))
                   if not cpu_has_instructions(dtype)]
        where = (f"cpu ({caps.get('cpu_name', 'unknown')}, torch threads: {torch.get_num_threads()}"
                 + (f"; no {' or '.join(missing)} instructions: torch emulates them" if missing else "") + ")")
    data = (f"MNIST's training images in seed {args.seed}'s order" if args.data == "mnist"
            else f"random MNIST-shaped images (1x28x28 uint8 / 255) and classes, seed {args.seed}")
    return (f"model={args.model} norm={args.norm}, micro-batch b={args.batch_size}, k={','.join(map(str, args.ks))}; "
            f"{data}; {where}; torch {torch.__version__}; {datetime.date.today().isoformat()}")


@dataclass
class Row:
    """One precision's measurements: its step's drift at each k, and its training (samples/s, peak bytes, bytes
    before the first step), None where not timed."""
    precision: PrecisionConfig
    drifts: list[PrecisionDrift]
    training: tuple[float, int, int | None] | None = None


def measure(args: argparse.Namespace, device: torch.device) -> list[Row]:
    configs = [precision_config(name) for name in args.precisions]
    for p in configs:
        problem = device_problem(p, device)
        if problem:
            raise ValueError(problem)
    split = data_split(args.data, args.data_root, args.batch_size * max(args.ks), args.seed)
    model = build_model(args.model, args.norm, args.seed, device)
    rows = []
    for p in configs:
        row = Row(p, errors(model, split, args.batch_size, args.ks, p, args.seed, device))
        if args.steps > 0:
            row.training = in_fresh_process(training, args.model, args.norm, p.name, args.batch_size, args.time_k,
                                            args.steps, args.seed, str(device), args.data, args.data_root)
        rows.append(row)
    return rows


def render(args: argparse.Namespace, device: torch.device, rows: Sequence[Row]) -> str:
    """The inputs, the command, what a cell says, and the table."""
    timed = f"k={args.time_k}" if args.steps > 0 else ""
    cells = [(label(row.precision), [cell(d, k) for d, k in zip(row.drifts, args.ks)],
              [f"{row.training[0]:.0f}", memory_cell(row.training[1], row.training[2], device)] if row.training else [])
             for row in rows]
    memory = ("" if not timed else "; peak memory: torch's allocated peak during the timed steps"
              if device.type == "cuda" else
              "; peak memory: the process's peak resident set, and in parentheses what the steps added to it")
    return "\n".join([
        f"gaexp.tools.drift: {inputs_line(args, device)}",
        f"command: {command(args)}",
        "each cell: the relative error against float64 of the accumulated gradient (k micro-batches of b, summed as "
        "the precision sums them), over all parameters; in parentheses one batch of b*k at the same precision; in "
        f"bold where gaexp-check calls accumulation measurably worse{memory}",
        "",
        table(cells, args.ks, timed)])


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.batch_size < 1 or args.steps < 0 or args.time_k < 1:
        parser().error(f"--batch-size {args.batch_size} --steps {args.steps} --time-k {args.time_k}; valid: "
                       "--batch-size >= 1, --steps >= 0, --time-k >= 1")
    try:
        device = resolve_device(args.device)
        print(render(args, device, measure(args, device)))
    except (ValueError, DataError) as e:
        print(f"python -m gaexp.tools.drift: error: {str(e).splitlines()[0]}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
