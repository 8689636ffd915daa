"""gaexp/optim.py: a run's Adam is torch's, bit for bit, and a CPU process that trains loads no compiler."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from gaexp.model import SimpleModel
from gaexp.norms import norm_layer
from gaexp.optim import CpuAdam, adam


def twins(norm: str, dtype: torch.dtype = torch.float32, frozen: bool = False) -> list[torch.nn.Module]:
    """Two SimpleModels with the same weights; `frozen`: the first layer's bias takes no gradient."""
    models = []
    for _ in range(2):
        torch.manual_seed(3)
        model = SimpleModel(norm_layer(norm)).to(dtype)
        if frozen:
            next(p for name, p in model.named_parameters() if name.endswith("bias")).requires_grad_(False)
        models.append(model)
    return models


def batches(steps: int, size: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(size, 1, 28, 28, generator=generator), torch.randint(0, 10, (size,), generator=generator))
            for _ in range(steps)]


def assert_same(theirs: torch.optim.Adam, ours: CpuAdam, a: torch.nn.Module, b: torch.nn.Module) -> None:
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
        if p in theirs.state:
            for key in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(theirs.state[p][key], ours.state[q][key]), key
        else:
            assert q not in ours.state


@pytest.mark.parametrize("norm, dtype, lr, frozen", [("gn4", torch.float32, 1e-3, False), ("bn", torch.float32, 0.1, False),
                                                     ("none", torch.bfloat16, 1e-3, False), ("gn4", torch.float32, 1e-3, True)])
def test_cpu_adam_steps_as_torchs_adam_bit_for_bit(norm, dtype, lr, frozen):
    """Every parameter and moment equal after each of 12 steps: both norms kinds, bf16 weights (precision=bf16w),
    a large learning rate, a parameter without a gradient."""
    a, b = twins(norm, dtype, frozen)
    theirs, ours = torch.optim.Adam(a.parameters(), lr=lr), adam(b.parameters(), lr)
    assert isinstance(ours, CpuAdam)
    for x, y in batches(12):
        for model, optimizer in ((a, theirs), (b, ours)):
            F.cross_entropy(model(x.to(dtype)).float(), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        assert_same(theirs, ours, a, b)
    assert all(p.grad is None for p in b.parameters())


def test_under_a_grad_scaler_both_skip_the_step_whose_gradient_is_not_finite():
    """fp16 on the CPU (precision=fp16's GradScaler): the scaler unscales our `param_groups` and skips our step as
    it skips torch's, the scale the same after."""
    a, b = twins("gn4")
    theirs, ours = torch.optim.Adam(a.parameters(), lr=1e-3), adam(b.parameters(), 1e-3)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10) for _ in range(2)]
    for step, (x, y) in enumerate(batches(6)):
        for model, optimizer, scaler in ((a, theirs, scalers[0]), (b, ours, scalers[1])):
            loss = F.cross_entropy(model(x), y) * (float("inf") if step == 2 else 1.0)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        assert_same(theirs, ours, a, b)
        assert scalers[0].get_scale() == scalers[1].get_scale()
    assert ours.state[next(b.parameters())]["step"].item() == 5  # 6 steps, one skipped


def test_off_the_cpu_a_run_takes_torchs_adam():
    """Where torch runs its foreach kernels (CUDA: here the meta device stands in), the run uses torch's Adam."""
    assert type(adam([torch.nn.Parameter(torch.zeros(3, device="meta"))], 1e-3)) is torch.optim.Adam


def test_a_cpu_process_that_trains_imports_no_compiler_where_torchs_adam_would(data_root):
    """gaexp's training loop on MNIST for 2 steps of bs4a2: no torch._dynamo (about 1.5 s of every process that
    trains), where a step of torch.optim.Adam imports it."""
    probe = ("import sys, torch; from gaexp.data import data_config, open_dataset; from gaexp.model import SimpleModel; "
             "from gaexp.norms import norm_layer; from gaexp.config import RegimeConfig, TrainConfig; "
             "from gaexp.train import StepPlan, train; "
             f"d = open_dataset(data_config('mnist', {str(data_root)!r}), progress=False); "
             "train(SimpleModel(norm_layer('gn4')), d.train, None, TrainConfig(num_iterations=2, eval_period=2), "
             "StepPlan(RegimeConfig(4, 2), 1)); print('torch._dynamo' in sys.modules); "
             "m = torch.nn.Linear(2, 2); o = torch.optim.Adam(m.parameters()); m(torch.ones(1, 2)).sum().backward(); "
             "o.step(); print('torch._dynamo' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.stdout.splitlines() == ["False", "True"], done.stderr[-2000:]
