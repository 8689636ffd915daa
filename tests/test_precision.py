"""gaexp/precision.py: the GradScaler's rules under accumulation, the dtype micro-batch gradients are summed in,
the engines under every precision, and fp32 as it was."""

from __future__ import annotations

import copy
import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gaexp import precision as precision_module
from gaexp.batched import Chunking, accumulate_batched
from gaexp.data.batches import micro_batches
from gaexp.config import PrecisionConfig, precision_name
from gaexp.model import SimpleModel
from gaexp.norms import norm_layer
from gaexp.precision import Precision, as_precision, device_problem, precision_config, slow_note
from gaexp.train import accumulate

CPU = torch.device("cpu")


def config(autocast="none", weights="fp32", accumulate_in="param", scaler=False) -> PrecisionConfig:
    return PrecisionConfig(autocast, weights, accumulate_in, scaler, precision_name(autocast, weights, accumulate_in, scaler))


def cnn(norm: str = "gn4", dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(1)
    return SimpleModel(norm_layer(norm)).to(dtype=dtype, memory_format=torch.channels_last)


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    x, y = (torch.cat([t.double().flatten() for t in ts]) for ts in (a, b))
    return ((x - y).norm() / y.norm()).item()


# --- fp32: the calls of before -------------------------------------------------------------------------

def test_fp32_computes_the_step_bit_for_bit_as_before_precision_was_a_choice(train_split):
    model, before = cnn("bn"), cnn("bn")
    loss = accumulate(model, train_split, micro_batches(len(train_split), 2, 1), 4, Precision(config(), CPU))
    batches, total = micro_batches(len(train_split), 2, 1), 0.0
    for _ in range(4):  # the loop as it was written before precision (gaexp 803bf02, gaexp/train.py)
        inputs, labels = train_split.batch(next(batches))
        step_loss = F.cross_entropy(before(inputs), labels)
        (step_loss / 4).backward()
        total += step_loss.detach()
    assert loss.item() == (total / 4).item()
    assert all(torch.equal(g, r) for g, r in zip(grads(model), grads(before)))
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), before.buffers()))  # BatchNorm's 4 updates


# --- the GradScaler under accumulation ------------------------------------------------------------------

class InfInBackward(nn.Module):
    """Identity forward; on its `at`-th call (1-based), the gradient through it becomes Inf: an overflow in
    that micro-batch's backward, the loss itself finite."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.calls = at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at:
            x = x.clone()
            x.register_hook(lambda g: g * float("inf"))
        return x


def net(at: int = 0) -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 16), InfInBackward(at), nn.ReLU(), nn.Linear(16, 10))


def test_the_scaler_scales_every_micro_batch_unscales_once_and_skips_a_step_with_inf_in_micro_batch_3_of_4(
        train_split, monkeypatch):
    unscales = []
    real = torch._amp_foreach_non_finite_check_and_unscale_
    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_",
                        lambda *a: unscales.append(1) or real(*a))  # GradScaler's one unscale-and-check per step
    scaled = config(scaler=True)  # fp32 with a scaler: the scaler's rules, with no rounding of fp16 in the way
    model, reference = net(), net()
    p = Precision(scaled, CPU)
    p.prepare(model)
    accumulate(model, train_split, micro_batches(len(train_split), 4, 1), 4, p)
    accumulate(reference, train_split, micro_batches(len(train_split), 4, 1), 4)
    assert p.scale == 2.0 ** 16
    assert all(torch.equal(g, 2.0 ** 16 * r) for g, r in zip(grads(model), grads(reference)))  # each loss scaled

    model = net(at=3)  # Inf in micro-batch 3 of 4's gradient
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    p = Precision(scaled, CPU)
    p.prepare(model)
    weights = copy.deepcopy(model.state_dict())
    loss = accumulate(model, train_split, micro_batches(len(train_split), 4, 1), 4, p)
    assert torch.isfinite(loss)  # the step's loss is finite: only its gradient overflowed
    assert p.step(optimizer) is True
    assert unscales == [1]  # unscaled and checked once, not per micro-batch
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())  # parameters untouched
    assert optimizer.state == {}  # Adam's moments and step count untouched
    assert (p.scale, p.skipped) == (2.0 ** 15, 1)  # the scale backed off once; the step counted as skipped
    optimizer.zero_grad(set_to_none=True)

    accumulate(model, train_split, micro_batches(len(train_split), 4, 2), 4, p)  # no Inf: the next step is taken
    assert p.step(optimizer) is False
    assert unscales == [1, 1]
    assert not all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    assert (p.scale, p.skipped) == (2.0 ** 15, 1)
    assert next(iter(optimizer.state.values()))["step"].item() == 1


def test_the_scaler_is_built_for_the_runs_own_device(train_split):
    """`torch.amp.GradScaler()` alone is CUDA's: on a machine without CUDA it turns itself off in silence, and on
    one with CUDA it cannot unscale CPU gradients. A CPU run's scaler must scale, on the CPU."""
    model, reference = cnn("gn4"), cnn("gn4")
    p = Precision(config(autocast="fp16", scaler=True), CPU)
    p.prepare(model)
    accumulate(model, train_split, micro_batches(len(train_split), 2, 1), 2, p)
    assert p.scaler.is_enabled() and p.scale == 2.0 ** 16
    accumulate(reference, train_split, micro_batches(len(train_split), 2, 1), 2, Precision(config("fp16"), CPU))
    assert rel([g / 2.0 ** 16 for g in grads(model)], grads(reference)) < 1e-2  # scaled by 2**16 on this device
    optimizer = torch.optim.Adam(model.parameters())
    assert p.step(optimizer) is False and p.skipped == 0


# --- where micro-batch gradients are summed -------------------------------------------------------------

@pytest.mark.parametrize("accumulate_in", ["param", "fp32"])
def test_bf16_weights_sum_their_micro_batch_gradients_where_accumulate_in_says(accumulate_in, train_split):
    """param: k bf16 additions in .grad; fp32: a float32 buffer, rounded to bf16 once. Compared bit for bit with
    the sums written out, and against the float64 sum: the float32 buffer is the closer at k = 16."""
    data = dataclasses.replace(train_split.take(slice(0, 256)), dtype=torch.bfloat16)
    k = 16
    model = cnn("gn4", torch.bfloat16)
    model.eval()  # GroupNorm has no running state; eval keeps every micro-batch's forward alike in both passes
    parts = []  # each micro-batch's own bf16 gradient of its loss / k, from the same weights
    batches = micro_batches(len(data), 1, 1)
    for _ in range(k):
        single = copy.deepcopy(model)
        inputs, labels = data.batch(next(batches))
        (F.cross_entropy(single(inputs).float(), labels) / k).backward()
        parts.append(grads(single))
    p = Precision(config(weights="bf16", accumulate_in=accumulate_in), CPU)
    p.prepare(model)
    accumulate(model, data, micro_batches(len(data), 1, 1), k, p)
    p.step(torch.optim.SGD(model.parameters(), lr=0.0))  # rounds the buffer into .grad; lr 0 changes nothing
    if accumulate_in == "param":
        expected = [sum(ts[1:], ts[0].clone()) for ts in zip(*parts)]  # bf16 + bf16, rounding each time, in order
    else:
        expected = [sum((t.float() for t in ts[1:]), ts[0].float()).to(torch.bfloat16) for ts in zip(*parts)]
    assert all(g.dtype == torch.bfloat16 for g in grads(model))
    assert all(torch.equal(g, e) for g, e in zip(grads(model), expected))
    exact = [sum(t.double() for t in ts) for ts in zip(*parts)]
    bf16_sum = [sum(ts[1:], ts[0].clone()) for ts in zip(*parts)]
    fp32_sum = [sum((t.float() for t in ts[1:]), ts[0].float()).to(torch.bfloat16) for ts in zip(*parts)]
    assert rel(fp32_sum, exact) < rel(bf16_sum, exact) / 2


# --- the engines under every precision ------------------------------------------------------------------

# How far the loop's and the batched engine's gradients of one step (b=2, k=8, GroupNorm CNN, MNIST) may be
# apart: float32 rounding; bf16 autocast rounds each micro-batch's weight gradient to bf16 in the loop, the
# whole step's once in the batched pass; fp16 likewise, finer; bf16 weights compute every layer in bf16.
ENGINES_AGREE = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 3e-3, "bf16w-acc32": 3e-2}


@pytest.mark.parametrize("name", list(ENGINES_AGREE))
def test_the_loop_and_the_batched_engine_agree_as_well_as_the_precision_allows(name, train_split):
    cfg = {"fp32": config(), "bf16": config("bf16"), "fp16": config("fp16", scaler=True),
           "bf16w-acc32": config(weights="bf16", accumulate_in="fp32")}[name]
    dtype = precision_module.DTYPES[cfg.weights]
    data = dataclasses.replace(train_split.take(slice(0, 512)), dtype=dtype)
    found = []
    for engine in ("loop", "batched"):
        model = cnn("gn4", dtype)
        p = Precision(cfg, CPU)
        p.prepare(model)
        batches = micro_batches(len(data), 2, 1)
        if engine == "loop":
            accumulate(model, data, batches, 8, p)
        else:
            accumulate_batched(model, data, batches, 8, p, chunking=Chunking(model, 2))
        p.step(torch.optim.SGD(model.parameters(), lr=0.0))
        found.append([g.float() / (p.scale or 1.0) for g in grads(model)])
    assert rel(*found) < ENGINES_AGREE[name], (name, rel(*found))


def test_bf16_weights_summed_in_bf16_are_the_loops_alone():
    from gaexp.engine import choose

    bf16w = config(weights="bf16")
    with pytest.raises(ValueError, match=r"^accumulate=batched: precision=bf16w sums 4 micro-batch gradients in "
                                         r"bf16, .*; valid: accumulate=loop or auto, or precision.accumulate_in=fp32"):
        choose("batched", cnn(), 4, 4, None, lambda e: None, bf16w)
    auto = choose("auto", cnn(), 4, 4, None, lambda e: None, bf16w)
    assert (auto.engine, auto.fell_back) == ("loop", True) and "sums 4 micro-batch gradients in bf16" in auto.reason
    assert choose("auto", cnn(), 16, 1, None, lambda e: None, bf16w).engine == "batched"  # k = 1: nothing summed
    assert choose("auto", cnn(), 4, 4, None, lambda e: None, config(weights="bf16", accumulate_in="fp32")).engine \
        == "batched"


# --- what a device can run, and what is slow --------------------------------------------------------------

@pytest.mark.parametrize("name", ["fp32", "bf16", "fp16", "bf16w", "bf16w-acc32"])
def test_the_cpu_runs_every_precision(name):
    cfg = {"fp32": config(), "bf16": config("bf16"), "fp16": config("fp16", scaler=True),
           "bf16w": config(weights="bf16"), "bf16w-acc32": config(weights="bf16", accumulate_in="fp32")}[name]
    assert cfg.name == name
    assert device_problem(cfg, CPU) is None


def test_a_device_that_cannot_run_a_precision_is_named_in_one_line(monkeypatch):
    def refuse(*a, **k):
        raise RuntimeError("In CPU autocast, but the target dtype is not supported. Disabling autocast.\nmore")
    monkeypatch.setattr(torch, "autocast", refuse)
    assert device_problem(config("fp16", scaler=True), CPU) == (
        "precision=fp16: cpu cannot train in it here (In CPU autocast, but the target dtype is not supported. "
        "Disabling autocast.); valid here: fp32")


def test_a_cpu_without_bf16_instructions_is_said_to_be_slow(monkeypatch):
    monkeypatch.setattr(precision_module, "cpu_has_instructions", lambda dtype: False)
    assert slow_note(config("bf16"), CPU) == (
        "precision=bf16: this CPU has no bf16 instructions (AVX512-BF16 or AMX-BF16); torch emulates them, several "
        "times slower than precision=fp32")
    assert slow_note(config(), CPU) is None
    monkeypatch.setattr(precision_module, "cpu_has_instructions", lambda dtype: True)
    assert slow_note(config("bf16"), CPU) is None


# --- a run under a precision, as recorded -----------------------------------------------------------------

def test_training_counts_a_skipped_step_and_reports_the_scale_at_each_evaluation(train_split, small_valid):
    from gaexp.config import RegimeConfig, TrainConfig
    from gaexp.train import StepPlan, train

    model = net(at=3)  # the third micro-batch of the first step overflows
    history = train(model, train_split, small_valid, TrainConfig(num_iterations=2, eval_period=1),
                    StepPlan(RegimeConfig(4, 4), 1, precision=Precision(config(scaler=True), CPU)))
    assert [(p.step, p.loss_scale, p.skipped_steps) for p in history] == [(1, 2.0 ** 15, 1), (2, 2.0 ** 15, 1)]
    plain = train(net(), train_split, small_valid, TrainConfig(num_iterations=1, eval_period=1), StepPlan(RegimeConfig(4, 4), 1))
    assert (plain[0].loss_scale, plain[0].skipped_steps) == (None, None)  # no scaler: nothing of its own


def test_an_fp16_run_records_its_precision_scale_and_skipped_steps(tmp_path, gaexp_command, training_runs):
    done = gaexp_command(tmp_path, "norm=gn4", "regime=bs4a4", "precision=fp16", "data.holdout=64",
                         "train.num_iterations=2", "train.eval_period=1")
    assert done.returncode == 0, done.stderr[-2000:]
    client, runs = training_runs(f"sqlite:///{tmp_path}/mlflow.db")
    run = runs["fp16-gn4-bs4a4-s1"]
    assert (run.data.tags["precision"], run.data.params["precision.autocast"], run.data.params["precision.scaler"]) \
        == ("fp16", "fp16", "True")
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss_scale")] == \
        [(1, 2.0 ** 16), (2, 2.0 ** 16)]
    assert run.data.metrics["skipped_steps"] == 0


def test_gaexps_precision_names_are_its_conf_files():
    assert precision_config("bf16w-acc32") == precision_config("bf16w", "fp32")
    assert as_precision(PrecisionConfig(autocast="bf16")) == precision_config("bf16") == as_precision("bf16")
    assert (precision_config("fp16").autocast, precision_config("fp16").scaler) == ("fp16", True)
    with pytest.raises(ValueError, match=re.escape("precision='bf8'; valid: bf16, bf16w, bf16w-acc32, fp16, fp32")):
        precision_config("bf8")
