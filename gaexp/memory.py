"""Memory, the reason gradient accumulation exists: activations held per micro-batch, process peaks."""

from __future__ import annotations

import copy
import resource
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from gaexp import metrics
from gaexp.config import BATCHED, LOOP, Config, RegimeConfig
from gaexp.data.batches import Draw, Split
from gaexp.data.dataset import data_bytes
from gaexp.task import Task
from gaexp.task.build import make as make_task

CGROUP = Path("/sys/fs/cgroup")  # a container's memory limit: cgroup v2's memory.max, else v1's memory/ controller


def activation_bytes(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                     loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy) -> int:
    """Bytes of the tensors autograd saves for backward in one forward of micro-batch `x` and its `loss` against
    `y` (a task's, gaexp/task/; default image classification's).

    Runs on a copy of the model, so BatchNorm's running statistics are untouched.
    Each memory region counts once (an in-place ReLU's output is the saved
    BatchNorm output); a saved view counts its own bytes, not its whole base
    tensor's; parameters are not activations and are left out.
    """
    model = copy.deepcopy(model).train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[tuple[int, int]] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            seen.add((t.data_ptr(), t.numel() * t.element_size()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss(model(x), y)
    return sum(nbytes for _, nbytes in seen)


def reset_peak_rss() -> bool:
    """Reset the process's peak RSS (Linux: /proc/self/clear_refs), so a reused worker measures one run."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _status_bytes(field: str, pid: int | str = "self") -> int | None:
    """A size of Linux's /proc/PID/status (VmHWM, VmRSS), in bytes; None elsewhere, or once the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """Peak resident set size since the last reset (VmHWM), else since the process started."""
    found = _status_bytes("VmHWM")
    return found if found is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_bytes(pid: int | str = "self") -> int | None:
    """The resident set of this process (or of `pid`) now (VmRSS), or None where Linux's /proc is not there."""
    return _status_bytes("VmRSS", pid)


def sample_bytes(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                 loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy) -> float:
    """`activation_bytes` per sample of the blank samples `x` (a task's probe of the data's shape): what each
    sample of a micro-batch adds to a step's memory."""
    return activation_bytes(model, x, y, loss) / len(x)


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):  # absent, or "max": no limit
        return None


def _stat(path: Path, name: str) -> int:
    try:
        return next((int(line.split()[1]) for line in path.read_text().splitlines() if line.startswith(name + " ")), 0)
    except (OSError, ValueError, IndexError):
        return 0


def available_bytes(device: torch.device, cgroup: Path = CGROUP) -> tuple[int, str] | None:
    """(bytes a run on `device` may take, where the figure comes from): a CUDA device's total memory; on the CPU
    what the kernel says can be allocated without swapping (MemAvailable), lowered to what this container's
    cgroup has left under its limit; None where neither is known."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return total, f"of memory on {torch.cuda.get_device_name(device)}"
    found = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found = (int(line.split()[1]) * 1024, "available on this machine (MemAvailable)")
    except (OSError, ValueError):
        pass
    for limit, usage, stat, cache in (("memory.max", "memory.current", "memory.stat", "inactive_file"),
                                      ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes",
                                       "memory/memory.stat", "total_inactive_file")):
        high, used = _read_int(cgroup / limit), _read_int(cgroup / usage)
        if high is not None and used is not None and high < 2**62:  # v1 writes "no limit" as a huge number
            left = max(0, high - used + _stat(cgroup / stat, cache))  # its page cache the kernel can drop
            if found is None or left < found[0]:
                found = (left, f"left under this container's memory limit ({cgroup / limit})")
            break
    return found


def holds_step(engine: str, task: Task, num_accum: int) -> bool:
    """Whether `engine` holds the activations of a step's b*k samples at once, not one micro-batch's: batched, and
    the loop of a loss over the whole step's outputs over k > 1 micro-batches (every graph held to the step's loss)."""
    return engine == BATCHED or (engine == LOOP and task.whole_outputs and num_accum > 1)


def size_text(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def check_run_memory(c: Config, model: torch.nn.Module, shape: tuple[int, int, int], device: torch.device,
                 accumulate: str | None = None) -> None:
    """A step's memory, estimated, within what this machine has (`available_bytes`): the activations of the
    samples held at once (one micro-batch; accumulate=batched: a step's b*k) at `sample_bytes` each, the data,
    the model with its gradients and Adam's two moments, and the record of each step's loss. Refused in one line
    naming the largest part and how far to lower it. Not checked where cells run on other hosts (their memory
    is not this one's) or where neither the model's measure nor the machine's memory is known. `accumulate`:
    the engine to check (default: the config's)."""
    if c.cells_elsewhere:
        return
    found = available_bytes(device)
    if found is None:
        return
    available, where = found
    try:
        job = make_task(c.task)
        per_sample = sample_bytes(model, *job.probe(shape, 0)[:2], job.loss) * job.views
    except Exception:  # noqa: BLE001 - a model that cannot run two blank images fails its run, saying why
        return
    b, k = c.regime.batch_size, c.regime.num_accum
    chosen = accumulate or c.accumulate
    batched = holds_step(chosen, job, k)
    held, steps = (b * k if batched else b), c.train.num_iterations
    data = data_bytes(c.data, shape)
    weights = 4 * sum(p.numel() * p.element_size() for p in model.parameters())  # + gradients, Adam's moments
    # each part: (what it is, its bytes, bytes per unit of the key that sets it, that key, what is valid: {} the
    # most units that fit)
    lighter = "cached" if job.whole_outputs else "loop"  # the engine that holds one micro-batch
    parts = [(f"{held:,} samples x {size_text(per_sample)} of activations", held * per_sample, per_sample,
              f"regime.batch_size={b} regime.num_accum={k} accumulate={chosen}" if batched else f"regime.batch_size={b}",
              f"regime.batch_size x regime.num_accum <= {{}} (or accumulate={lighter}, which holds regime.batch_size "
              "samples)" if batched else "regime.batch_size <= {}"),
             (f"{size_text(4 * steps)} recording {steps:,} steps' losses", 4 * steps, 4,
              f"train.num_iterations={steps}", "train.num_iterations <= {}"),
             (f"{size_text(data)} of data", data, 0, f"data={c.data.dataset}", None),
             (f"{size_text(weights)} of model, gradients and Adam", weights, 0, f"model={c.model.name}", None)]
    need = sum(part[1] for part in parts)
    if need <= available:
        return
    _, worst, unit, name, fix = max(parts, key=lambda part: part[1])
    room = available - (need - worst)
    valid = fix.format(f"{int(room // unit):,}") if unit and room >= unit else "less of each of these"
    raise ValueError(f"{name}: a run needs about {size_text(need)} on {device.type} ({'; '.join(p[0] for p in parts)}),"
                     f" more than the {size_text(available)} {where}; valid: {valid}")


def memory_problem(c: Config, model: torch.nn.Module, shape: tuple[int, int, int], device: torch.device,
                   accumulate: str) -> str | None:
    """`check_run_memory`'s one line for this engine, or None when a step fits."""
    try:
        check_run_memory(c, model, shape, device, accumulate)
    except ValueError as e:
        return str(e)
    return None


def measure_memory(model: torch.nn.Module, data: Split, regime: RegimeConfig, engine: str,
                   device: torch.device, job: Task) -> dict[str, float]:
    """MiB autograd saves for one micro-batch (`activation_mb`: what the loop and the cached engine hold, whichever
    engine runs: the study's memory column) and, for an engine that holds the b*k samples of a step (batched; the
    loop of a loss over the step's outputs), for those (`batched_activation_mb`); then the process peaks start from
    here."""
    b, n = regime.batch_size, regime.batch_size * regime.num_accum
    first = (data.batch(Draw(torch.arange(size, device=data.labels.device))) for size in (b, n))
    memory = {metrics.ACTIVATION_MB.name: activation_bytes(model, *next(first), job.loss) / 2**20}
    if holds_step(engine, job, regime.num_accum):
        memory[metrics.BATCHED_ACTIVATION_MB.name] = activation_bytes(model, *next(first), job.loss) / 2**20
    reset_peak_rss()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return memory
