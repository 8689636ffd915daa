"""Memory, the reason gradient accumulation exists: activations held per micro-batch, process peaks."""

from __future__ import annotations

import copy
import resource
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

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
