"""The BatchNorm remedies on hand-made tensors: each against the exact quantity it claims to compute."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from gaexp.config import RegimeConfig, TrainConfig
from gaexp.model import SimpleModel
from gaexp.layers import (BatchRenorm2d, MicroBatchEvalBatchNorm2d, PreciseBatchNorm2d, PreciseStatistics, kmom,
                          precise_statistics)
from gaexp.norms import NORMS, norm_layer
from gaexp.train import StepPlan, train

BN_LIKE = dict(r_max=1.0, d_max=0.0, warmup_steps=0, ramp_steps=0)  # Batch Renorm with no correction: BatchNorm


def batches_with_shifting_means(n_batches=5, size=4, channels=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(size, channels, 5, 5, generator=g, dtype=torch.float64) * (1 + i) + 3 * i
            for i in range(n_batches)]


def test_precise_statistics_are_the_exact_population_mean_and_variance():
    layer = PreciseBatchNorm2d(3, stats_batch_size=4, stats_samples=20).double()
    layer.num_batches_tracked.fill_(7)
    layer.eval()
    batches = batches_with_shifting_means()
    precise_statistics(layer, batches)
    everything = torch.cat(batches)
    assert torch.allclose(layer.running_mean, everything.mean(dim=(0, 2, 3)), rtol=0, atol=1e-12)
    assert torch.allclose(layer.running_var, everything.var(dim=(0, 2, 3), unbiased=False), rtol=0, atol=1e-10)
    mean_of_batch_vars = torch.stack([b.var(dim=(0, 2, 3), unbiased=False) for b in batches]).mean(0)
    assert (layer.running_var - mean_of_batch_vars).abs().min() > 1.0  # the between-batch spread is counted
    assert not layer.training and int(layer.num_batches_tracked) == 7  # mode and counter restored


def test_precise_statistics_of_a_deeper_layer_see_the_upstream_train_mode_output():
    first, second = PreciseBatchNorm2d(3, 4, 20).double(), PreciseBatchNorm2d(3, 4, 20).double()
    with torch.no_grad():
        first.weight.copy_(torch.tensor([2.0, 0.5, 1.0]))
        first.bias.copy_(torch.tensor([1.0, -1.0, 0.0]))
    model = nn.Sequential(first, nn.ReLU(), second)
    batches = batches_with_shifting_means(seed=1)
    precise_statistics(model, batches)
    reference = copy.deepcopy(first).train()
    seen = torch.cat([torch.relu(reference(b)) for b in batches])  # upstream normalized by its own batch
    assert torch.allclose(second.running_mean, seen.mean(dim=(0, 2, 3)), atol=1e-12)
    assert torch.allclose(second.running_var, seen.var(dim=(0, 2, 3), unbiased=False), atol=1e-10)


def test_micro_batch_evaluation_never_touches_the_running_buffers():
    layer = MicroBatchEvalBatchNorm2d(3, micro_batch=4).double().eval()
    with torch.no_grad():
        layer.running_mean.fill_(100.0)
        layer.running_var.fill_(1e-6)  # absurd values: the output must not depend on them
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    x = batches_with_shifting_means(n_batches=1, size=10)[0]
    out = layer(x)
    assert all(torch.equal(before[k], v) for k, v in layer.state_dict().items())
    reference = nn.BatchNorm2d(3).double().train()
    reference.load_state_dict(before)
    expected = torch.cat([reference(x[i:i + 4]) for i in (0, 4, 8)])  # groups of 4, 4, then the last 2
    assert torch.allclose(out, expected, atol=1e-12)


def test_micro_batch_one_evaluation_is_the_per_sample_result():
    layer = MicroBatchEvalBatchNorm2d(3, micro_batch=1).double()
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([1.5, 0.5, 2.0]))
        layer.bias.copy_(torch.tensor([0.1, 0.2, 0.3]))
    x = batches_with_shifting_means(n_batches=1, size=6)[0]
    out = layer.eval()(x)
    per_sample = torch.cat([copy.deepcopy(layer).train()(x[i:i + 1]) for i in range(6)])
    as_instance_norm = nn.functional.instance_norm(x, weight=layer.weight, bias=layer.bias, eps=layer.eps)
    assert torch.allclose(out, per_sample, atol=1e-12) and torch.allclose(out, as_instance_norm, atol=1e-12)


def test_batch_renorm_with_r_one_and_d_zero_is_batch_norm():
    torch.manual_seed(0)
    brn = BatchRenorm2d(3, num_accum=1, **BN_LIKE).double()
    bn = nn.BatchNorm2d(3).double()
    with torch.no_grad():
        for layer in (brn, bn):
            layer.weight.copy_(torch.tensor([1.5, 0.5, 2.0]))
            layer.bias.copy_(torch.tensor([0.1, 0.2, 0.3]))
    for x in batches_with_shifting_means():
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = brn(xa), bn(xb)
        assert torch.allclose(ya, yb, atol=1e-12)
        (ya * torch.arange(ya.numel(), dtype=ya.dtype).reshape(ya.shape)).sum().backward()
        (yb * torch.arange(yb.numel(), dtype=yb.dtype).reshape(yb.shape)).sum().backward()
        assert torch.allclose(xa.grad, xb.grad, atol=1e-9)
    assert torch.allclose(brn.weight.grad, bn.weight.grad, atol=1e-9)
    assert torch.allclose(brn.running_mean, bn.running_mean, atol=1e-12)
    assert torch.allclose(brn.running_var, bn.running_var, atol=1e-12)
    assert int(brn.num_batches_tracked) == int(bn.num_batches_tracked) == 5
    brn.eval(), bn.eval()
    x = batches_with_shifting_means(n_batches=1, seed=3)[0]
    assert torch.allclose(brn(x), bn(x), atol=1e-12)


def test_batch_renorm_corrects_towards_the_running_statistics_within_the_clip():
    brn = BatchRenorm2d(1, num_accum=1, r_max=3.0, d_max=0.5, warmup_steps=0, ramp_steps=0).double()
    with torch.no_grad():
        brn.running_mean.fill_(1.0)
        brn.running_var.fill_(4.0 - brn.eps)  # running std 2
    x = torch.tensor([[[[0.0, 2.0]]], [[[0.0, 2.0]]]], dtype=torch.float64)  # batch mean 1, std 1
    # r = sigma_B / sigma = 1/2 (inside [1/3, 3]), d = (1 - 1)/2 = 0: x_hat = (x - mu_B) / sigma_B * r = (x - 1) / 2
    assert torch.allclose(brn(x), (x - 1) / 2, atol=1e-12)
    with torch.no_grad():
        brn.running_mean.fill_(11.0)  # d = (1 - 11)/2 = -5, clipped to -0.5
        brn.running_var.fill_(4.0 - brn.eps)
    assert torch.allclose(brn(x), (x - 1) / 2 - 0.5, atol=1e-12)


def test_batch_renorm_warm_up_counts_optimizer_steps_not_micro_batches():
    brn = BatchRenorm2d(1, num_accum=4, r_max=3.0, d_max=5.0, warmup_steps=10, ramp_steps=20)
    for micro_batches, limits in [(0, (1.0, 0.0)), (4 * 10 + 3, (1.0, 0.0)), (4 * 20, (2.0, 2.5)), (4 * 30, (3.0, 5.0)),
                                  (4 * 1000, (3.0, 5.0))]:
        brn.num_batches_tracked.fill_(micro_batches)
        assert brn.limits() == pytest.approx(limits)


def test_k_momentum_decays_like_one_update_per_optimizer_step():
    k = 16
    assert kmom(0.1, 1) == pytest.approx(0.1)
    layer, reference = norm_layer("bn_kmom", num_accum=k, momentum=0.1)(2), nn.BatchNorm2d(2)
    assert layer.momentum == pytest.approx(1 - 0.9 ** (1 / 16)) and layer.momentum == pytest.approx(0.006563, abs=1e-6)
    x = torch.full((1, 2, 3, 3), 5.0) + torch.arange(9.0).reshape(1, 1, 3, 3)
    for _ in range(k):
        layer(x)
    reference(x)
    assert torch.allclose(layer.running_mean, reference.running_mean, atol=1e-5)
    assert torch.allclose(layer.running_var, reference.running_var, atol=1e-5)


def test_ln_and_in_affine():
    ln, ina = norm_layer("ln")(32), norm_layer("in_affine")(32)
    assert isinstance(ln, nn.GroupNorm) and ln.num_groups == 1 and ln.affine
    assert isinstance(ina, nn.InstanceNorm2d) and ina.affine and not ina.track_running_stats


def test_eval_only_remedies_train_exactly_like_bn(train_split, small_valid):
    """bn_precise, bn_microeval and bn_kmom differ from bn only in evaluation statistics: same weights after training."""
    def trained(norm, **options):
        torch.manual_seed(3)
        model = SimpleModel(norm_layer(norm, **options))
        history = train(model, train_split, small_valid, TrainConfig(num_iterations=6, eval_period=3), StepPlan(RegimeConfig(1, 4),
                        3), hooks=NORMS[norm].hooks_for(model, train_split, seed=3))
        return model, history

    bn, bn_history = trained("bn")
    for norm, options in [("bn_precise", {"stats_batch_size": 4, "stats_samples": 64}), ("bn_microeval", {"micro_batch": 1}),
                          ("bn_kmom", {"num_accum": 4, "momentum": 0.1})]:
        model, history = trained(norm, **options)
        assert all(torch.equal(a, b) for a, b in zip(bn.parameters(), model.parameters())), norm
        assert [p.train_loss for p in history] == [p.train_loss for p in bn_history], norm
    precise, _ = trained("bn_precise", stats_batch_size=4, stats_samples=64)
    first = next(m for m in precise.modules() if isinstance(m, PreciseBatchNorm2d))
    assert not torch.allclose(first.running_mean, next(m for m in bn.modules() if isinstance(m, nn.BatchNorm2d)).running_mean)


def test_only_precise_bn_registers_a_hook(train_split):
    assert [name for name, norm in NORMS.items() if norm.hooks is not None] == ["bn_precise"]
    assert NORMS["bn"].hooks_for(SimpleModel(norm_layer("bn")), train_split, seed=1) == []
    model = SimpleModel(norm_layer("bn_precise", stats_batch_size=4, stats_samples=64))
    (hook,) = NORMS["bn_precise"].hooks_for(model, train_split, seed=1)
    assert isinstance(hook, PreciseStatistics) and (hook.batch_size, hook.samples) == (4, 64)
