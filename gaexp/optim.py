"""A run's optimizer: Adam at the run's learning rate, torch's defaults otherwise (betas 0.9 and 0.999, eps 1e-8,
no weight decay).

On the CPU it is `CpuAdam`: torch.optim.Adam's single-tensor path (the one torch takes for CPU tensors) written out
op for op, so a step leaves every parameter and moment bit for bit where torch's leaves them (tests/test_optim.py
holds the two equal). torch's own optimizers import torch._dynamo, the compiler, on their first step (their step
wrapper and `add_param_group` call into it), about 1.5 s of CPU in every process that trains; a cell that compiles
nothing needs none of it. Off the CPU, torch's Adam runs its foreach kernels, and a run there uses it.
"""

from __future__ import annotations

from typing import Iterable, Union

import torch

BETAS = (0.9, 0.999)
EPS = 1e-8


class CpuAdam:
    """torch.optim.Adam(params, lr) for CPU tensors without torch.optim: `param_groups` and `state` as torch's (what
    a GradScaler unscales and skips by), `step` and `zero_grad` computing what torch's compute."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float) -> None:
        self.param_groups = [{"params": list(params), "lr": lr, "betas": BETAS, "eps": EPS}]
        self.state: dict[torch.Tensor, dict] = {}

    @torch.no_grad()
    def step(self) -> None:
        """One Adam step for every parameter with a gradient, in torch's order of operations (torch.optim.adam's
        `_single_tensor_adam`, amsgrad, maximize and weight decay off)."""
        for group in self.param_groups:
            (beta1, beta2), lr, eps = group["betas"], group["lr"], group["eps"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state.get(param)
                if state is None:
                    state = self.state[param] = {
                        "step": torch.tensor(0.0),  # a float32 count, read back as a float: as torch keeps it
                        "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format)}
                grad, exp_avg, exp_avg_sq = param.grad, state["exp_avg"], state["exp_avg_sq"]
                state["step"] += 1
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                step = state["step"].item()
                step_size = lr / (1 - beta1**step)
                denom = (exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
                param.addcdiv_(exp_avg, denom, value=-step_size)

    def zero_grad(self) -> None:
        """Every gradient to None, as torch's `zero_grad()` by default."""
        for group in self.param_groups:
            for param in group["params"]:
                param.grad = None


Optimizer = Union[CpuAdam, torch.optim.Optimizer]


def adam(params: Iterable[torch.nn.Parameter], lr: float) -> Optimizer:
    """A run's Adam: `CpuAdam` where every parameter is on the CPU (where torch's takes its single-tensor path),
    torch.optim.Adam elsewhere."""
    params = list(params)
    return CpuAdam(params, lr) if all(p.device.type == "cpu" for p in params) else torch.optim.Adam(params, lr=lr)
