"""The model's state and the random streams, kept before the check and given back after it: parameters, buffers,
`.grad`, training flags; torch's (CPU and each CUDA device's), Python's and NumPy's random streams.
"""

from __future__ import annotations

import random

import numpy as np
import torch
from torch import nn


class Kept:
    """The model's buffers, gradients and training flags, as they were, to restore. (A forward and a backward
    change buffers, such as running statistics, never parameters: those are not copied, which keeps a model of
    600M parameters within memory.)"""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
        self.grads = [p.grad for p in model.parameters()]
        self.training = {m: m.training for m in model.modules()}

    def restore_buffers(self) -> None:
        """Copied back in place: load_state_dict would need the state's metadata (MNASNet refuses it without)."""
        with torch.no_grad():
            for k, v in self.model.named_buffers():
                if k in self.buffers:
                    v.copy_(self.buffers[k])

    def restore_all(self) -> None:
        self.restore_buffers()
        for p, g in zip(self.model.parameters(), self.grads):
            p.grad = g
        for m, flag in self.training.items():
            m.training = flag


class Streams:
    """The random streams a module may draw from: torch's (CPU and each CUDA device), Python's, NumPy's."""

    def __init__(self, devices: list[int]) -> None:
        self.devices = devices

    def state(self) -> tuple:
        cuda = tuple(torch.cuda.get_rng_state(d) for d in self.devices)
        return torch.get_rng_state(), cuda, random.getstate(), np.random.get_state()

    def set(self, state: tuple) -> None:
        cpu, cuda, python, numpy = state
        torch.set_rng_state(cpu)
        for d, s in zip(self.devices, cuda):
            torch.cuda.set_rng_state(s, d)
        random.setstate(python)
        np.random.set_state(numpy)

    def seed(self, seed: int) -> None:
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % 2**32)

    @staticmethod
    def drawn(before: tuple, after: tuple) -> str:
        """Which stream moved between two states ('' when none)."""
        if not torch.equal(before[0], after[0]) or any(not torch.equal(a, b) for a, b in zip(before[1], after[1])):
            return "torch's random stream"
        if before[2] != after[2]:
            return "Python's random module"
        b, a = before[3], after[3]
        if b[2:] != a[2:] or not np.array_equal(b[1], a[1]):
            return "NumPy's random stream"
        return ""


def cuda_devices(model: nn.Module) -> list[int]:
    return sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
