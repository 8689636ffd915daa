"""Memory, the reason gradient accumulation exists: activations held per micro-batch, process peaks."""

from __future__ import annotations

import copy
import resource
from pathlib import Path

import torch
import torch.nn.functional as F


def activation_bytes(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes of the tensors autograd saves for backward in one forward of micro-batch `x`.

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
        F.cross_entropy(model(x), y)
    return sum(nbytes for _, nbytes in seen)


def reset_peak_rss() -> bool:
    """Reset the process's peak RSS (Linux: /proc/self/clear_refs), so a reused worker measures one run."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """Peak resident set size since the last reset (VmHWM), else since the process started."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
