"""accumulate=batched against the loop: the same arithmetic for every norm of the registry and regime of the
grid, after one step and after 20 (gradients, parameters, running buffers, Batch Renorm's r and d), and the
layers it refuses.

The proofs run in float64. In float32 the two engines, like any two summation orders (the loop eager against
the loop compiled), end steps apart: a convolution's bias in front of a norm has a true gradient of zero,
the computed one is rounding noise of either sign, and Adam turns it into a full step of lr (its update is
m / (sqrt(v) + 1e-8), about sign(g) when |g| is above 1e-8), moving those biases and the running means
they shift by up to lr per step. In float64 that noise (~1e-17) stays below Adam's epsilon, so what is left
is rounding: below 1e-7 relative after 20 steps, where computing differently (chunks out of order, or a
BatchNorm over the whole b*k) differs by more than 1e-3.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from gaexp.batched import Chunking, UnchunkableError, accumulate_batched, coupled_layers
from gaexp.data.batches import micro_batches
from gaexp.model import ResNet20, SimpleModel
from gaexp.layers import BatchRenorm2d
from gaexp.config import CustomNormConfig
from gaexp.norms import NORMS, norm_layer
from gaexp.train import accumulate, step_function
from tests.conftest import Float64

MODELS = {"simple": SimpleModel, "resnet20": ResNet20}
GRID_NORMS = ["bn", "in", "gn4", "gn16", "none"]
REMEDIES = ["ln", "in_affine", "bn_kmom", "brn", "bn_precise", "bn_microeval"]
COUPLED_NORMS = [n for n in GRID_NORMS + REMEDIES if NORMS[n].couples]  # as each norm declares itself
PER_SAMPLE_NORMS = [n for n in GRID_NORMS + REMEDIES if not NORMS[n].couples]
REGIMES = {"bs1a1": (1, 1), "bs1a16": (1, 16), "bs4a4": (4, 4), "bs16a1": (16, 1)}
STEPS = 20
# float64 rounding: after one step measured up to 3e-11, after 20 up to 1.1e-8 (BatchNorm at bs4a4: the biases in
# front of it follow their rounding noise, and 20 Adam steps grow it); computing differently gives > 1e-3.
TOLERANCE = 1e-7


# A norm of one's own, in one file: BatchNorm that only centres (mean-only BatchNorm), its coupling declared.
USER_NORM_FILE = """
import torch
from torch import nn


class MeanOnlyBatchNorm2d(nn.BatchNorm2d):
    couples_samples = True  # its batch mean couples the samples: accumulate=batched runs it per micro-batch

    def forward(self, x):
        if not self.training:
            return (x - self.running_mean[:, None, None]) * self.weight[:, None, None] + self.bias[:, None, None]
        mean = x.mean(dim=(0, 2, 3))
        with torch.no_grad():
            self.running_mean.lerp_(mean.detach(), self.momentum)
            self.num_batches_tracked.add_(1)
        return (x - mean[:, None, None]) * self.weight[:, None, None] + self.bias[:, None, None]


class Undeclared(MeanOnlyBatchNorm2d):
    couples_samples = None  # says nothing: a subclass of BatchNorm with its own forward, refused by batched


def declared_factory(channels):  # a factory declares for the layers it builds
    return Undeclared(channels)


declared_factory.couples_samples = True
"""
USER_NORM = "mine_bn:MeanOnlyBatchNorm2d"


@pytest.fixture
def user_norm(tmp_path, monkeypatch) -> str:
    """USER_NORM_FILE written as mine_bn.py on the import path; its target."""
    (tmp_path / "mine_bn.py").write_text(USER_NORM_FILE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "mine_bn", raising=False)
    return USER_NORM


def study_layer(norm: str, b: int, k: int):
    if ":" in norm:  # a norm of one's own, as norm=custom norm.target=... builds it
        return norm_layer(CustomNormConfig(name="mean_bn", target=norm))
    options = {"bn_kmom": {"num_accum": k, "momentum": 0.1},
               # r and d clipped at their maxima from the first step, so the corrections act in every chunk
               "brn": {"num_accum": k, "r_max": 3.0, "d_max": 5.0, "warmup_steps": 0, "ramp_steps": 0},
               "bn_precise": {"stats_batch_size": 16, "stats_samples": 64},
               "bn_microeval": {"micro_batch": b}}.get(norm, {})
    return norm_layer(norm, **options)


def build(norm: str, b: int, k: int, model: str = "simple", float64: bool = True) -> nn.Module:
    torch.manual_seed(1)
    net = MODELS[model](study_layer(norm, b, k)).to(memory_format=torch.channels_last)
    return Float64(net) if float64 else net


def record_corrections(net: nn.Module) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per Batch Renorm layer, every (r, d) it computes, in order (one per call: per micro-batch, or per chunk)."""
    seen: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    for m in net.modules():
        if isinstance(m, BatchRenorm2d):
            seen.append([])

            def corrections(mean, std, compute=m.corrections, calls=seen[-1]):
                r, d = compute(mean, std)
                calls.append((r.clone(), d.clone()))
                return r, d
            m.corrections = corrections
    return seen


def trajectory(engine: str, norm: str, b: int, k: int, data, model: str = "simple", float64: bool = True,
               steps: int = STEPS) -> tuple[dict, list]:
    """Adam from the seed-1 weights for `steps` steps of `engine`; after steps 1 and `steps`: the step's
    gradients, then the parameters and buffers the optimizer step leaves; and Batch Renorm's (r, d)."""
    net = build(norm, b, k, model, float64)
    corrections = record_corrections(net)
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    gradient = step_function(engine, net, b)
    batches = micro_batches(len(data.labels), b, 1)
    snapshots = {}
    for step in range(1, steps + 1):
        gradient(net, data, batches, k)
        grads = [p.grad.clone() for p in net.parameters()]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step in (1, steps):
            snapshots[step] = {"grads": grads, "params": [p.detach().clone() for p in net.parameters()],
                               "buffers": [t.clone() for t in net.buffers() if t.is_floating_point()],
                               "counts": [t.clone() for t in net.buffers() if not t.is_floating_point()]}
    return snapshots, corrections


def worst(tensors: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """The largest ||t - r|| / ||r|| over the tensors; the floor 1e-6 of the whole set's norm keeps a tensor
    whose true value is zero (a convolution's bias gradient in front of a norm: rounding noise) from
    dividing by zero."""
    if not reference:
        return 0.0
    total = torch.cat([r.flatten() for r in reference]).norm()
    return max(((t - r).norm() / (r.norm() + 1e-6 * total)).item() for t, r in zip(tensors, reference))


def differences(a: dict, b: dict) -> dict:
    return {(step, kind): worst(a[step][kind], b[step][kind]) for step in a for kind in ("grads", "params", "buffers")}


@pytest.mark.parametrize("norm,regime", [*((n, "bs4a4") for n in GRID_NORMS + REMEDIES),
                                         *((n, "bs1a16") for n in COUPLED_NORMS)])
def test_batched_computes_what_the_loop_computes(norm, regime, train_split):
    """Every norm at bs4a4; at bs1a16 those that couple (the others are the true batch to the bit, below)."""
    b, k = REGIMES[regime]
    loop, loop_rd = trajectory("loop", norm, b, k, train_split)
    batched, batched_rd = trajectory("batched", norm, b, k, train_split)
    found = differences(batched, loop)
    assert max(found.values()) < TOLERANCE, found
    for step in loop:
        assert [c.tolist() for c in batched[step]["counts"]] == [c.tolist() for c in loop[step]["counts"]]
    assert [len(calls) for calls in batched_rd] == [len(calls) for calls in loop_rd] == \
        ([STEPS * k] * 4 if norm == "brn" else [])
    for calls, loop_calls in zip(batched_rd, loop_rd):
        for (r, d), (r_loop, d_loop) in zip(calls, loop_calls):
            assert torch.allclose(r, r_loop, rtol=TOLERANCE, atol=0) and torch.allclose(d, d_loop, rtol=0,
                                                                                        atol=TOLERANCE)
    if norm == "brn":  # the corrections did act: r left 1 and d left 0 somewhere
        assert max((r - 1).abs().max().item() for calls in loop_rd for r, _ in calls) > 0.1
        assert max(d.abs().max().item() for calls in loop_rd for _, d in calls) > 0.1


@pytest.mark.parametrize("regime", ["bs1a16", "bs4a4"])
def test_a_users_coupled_norm_in_one_file_batched_computes_what_the_loop_computes(regime, train_split, user_norm,
                                                                                  monkeypatch):
    """The proof above for a norm gaexp has never seen: its layers are chunked because they say they couple."""
    b, k = REGIMES[regime]
    assert [name for name, _ in coupled_layers(build(user_norm, b, k))] == [f"model.features.{i}" for i in (1, 5, 9, 13)]
    loop, _ = trajectory("loop", user_norm, b, k, train_split)
    batched, _ = trajectory("batched", user_norm, b, k, train_split)
    found = differences(batched, loop)
    assert max(found.values()) < TOLERANCE, found
    assert [c.tolist() for c in batched[STEPS]["counts"]] == [c.tolist() for c in loop[STEPS]["counts"]] == \
        [STEPS * k] * 4  # every micro-batch updated the running mean, in both engines
    import gaexp.batched as batched_module  # what the declaration buys: the same model unchunked differs
    monkeypatch.setattr(batched_module, "chunked", lambda layer, b: layer.forward)
    whole, _ = trajectory("batched", user_norm, b, k, train_split, steps=2)
    assert max(differences(whole, trajectory("loop", user_norm, b, k, train_split, steps=2)[0]).values()) > 1e-3


def test_a_norm_of_ones_own_is_chunked_as_it_declares_or_refused(user_norm):
    assert len(coupled_layers(build("mine_bn:declared_factory", 4, 4))) == 4  # the factory's word, on each layer
    with pytest.raises(UnchunkableError, match=r"^accumulate=batched: layer 'model.features.1' is a mine_bn.Undeclared"):
        coupled_layers(build("mine_bn:Undeclared", 4, 4))


@pytest.mark.parametrize("norm", GRID_NORMS + REMEDIES)
def test_one_micro_batch_per_step_is_the_loop_bit_for_bit(norm, train_split):
    """bs1a1 and bs16a1: one micro-batch per step, so batched is the loop's very call, in float32 too."""
    for regime in ("bs1a1", "bs16a1"):
        b, k = REGIMES[regime]
        loop, _ = trajectory("loop", norm, b, k, train_split, float64=False, steps=3)
        batched, _ = trajectory("batched", norm, b, k, train_split, float64=False, steps=3)
        for step in loop:
            for kind in ("grads", "params", "buffers", "counts"):
                assert all(torch.equal(x, y) for x, y in zip(batched[step][kind], loop[step][kind])), (regime, kind)


@pytest.mark.parametrize("norm", PER_SAMPLE_NORMS)
def test_batch_independent_norms_batched_over_micro_batches_are_the_true_batch_bit_for_bit(norm, train_split):
    """Nothing to chunk: batched bs1a16 and bs4a4 are one pass over the same 16 samples as bs16a1, the
    same float32 arithmetic, so the same run."""
    reference, _ = trajectory("loop", norm, 16, 1, train_split, float64=False, steps=3)
    for b, k in [(1, 16), (4, 4)]:
        batched, _ = trajectory("batched", norm, b, k, train_split, float64=False, steps=3)
        for kind in ("grads", "params"):
            assert all(torch.equal(x, y) for x, y in zip(batched[3][kind], reference[3][kind])), (b, k, kind)


@pytest.mark.parametrize("norm", ["bn", "brn", "gn4"])
def test_resnet20_batched_computes_what_the_loop_computes(norm, train_split):
    loop, loop_rd = trajectory("loop", norm, 4, 4, train_split, model="resnet20", steps=5)
    batched, batched_rd = trajectory("batched", norm, 4, 4, train_split, model="resnet20", steps=5)
    found = differences(batched, loop)
    assert max(found.values()) < TOLERANCE, found
    assert [len(calls) for calls in batched_rd] == [len(calls) for calls in loop_rd] == \
        ([5 * 4] * 19 if norm == "brn" else [])
    for calls, loop_calls in zip(batched_rd, loop_rd):
        assert all(torch.allclose(r, r_loop, rtol=TOLERANCE, atol=0) and torch.allclose(d, d_loop, rtol=0, atol=TOLERANCE)
                   for (r, d), (r_loop, d_loop) in zip(calls, loop_calls))


def test_chunking_out_of_order_or_not_at_all_is_caught(train_split, monkeypatch):
    """What the tolerance separates: BatchNorm over the whole b*k, or over the chunks in reverse order."""
    loop, _ = trajectory("loop", "bn", 4, 4, train_split, steps=2)
    import gaexp.batched as batched_module

    def whole(layer, b):
        return layer.forward
    monkeypatch.setattr(batched_module, "chunked", whole)
    assert max(differences(trajectory("batched", "bn", 4, 4, train_split, steps=2)[0], loop).values()) > 1e-3

    def reversed_order(layer, b):
        forward = layer.forward
        return lambda x: torch.cat([forward(c) for c in x.split(b)[::-1]][::-1])
    monkeypatch.setattr(batched_module, "chunked", reversed_order)
    assert max(differences(trajectory("batched", "bn", 4, 4, train_split, steps=2)[0], loop).values()) > 1e-3


class MeanOverBatch(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(dim=0, keepdim=True)


def test_a_layer_gaexp_does_not_know_is_refused_in_one_line():
    net = nn.Sequential(nn.Conv2d(1, 4, 3), MeanOverBatch(), nn.Flatten(), nn.Linear(4 * 26 * 26, 10))
    with pytest.raises(UnchunkableError, match=r"^accumulate=batched: layer '1' is a test_batched.MeanOverBatch, "
                                               r"not a layer gaexp knows .*\(known: .*BatchNorm2d.*GroupNorm.*\); "
                                               r"run accumulate=loop$"):
        coupled_layers(net)
    with pytest.raises(UnchunkableError, match="nn.modules.dropout.Dropout"):
        coupled_layers(nn.Sequential(nn.Linear(3, 3), nn.Dropout()))
    with pytest.raises(UnchunkableError, match="layer 'the model'"):
        coupled_layers(MeanOverBatch())
    with pytest.raises(UnchunkableError, match=r"layer '0' is a test_batched.ScaledByBatch"):  # its own forward and
        coupled_layers(nn.Sequential(ScaledByBatch()))  # parameter beside children: not read as a composition


class ScaledByBatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.gain = nn.Conv2d(1, 4, 3), nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return self.gain * y / y.std()


class DeclaredMeanOverBatch(MeanOverBatch):
    couples_samples = True  # a layer of one's own that says it couples its batch: chunked, not refused


def test_the_coupling_layers_are_the_batchnorms_and_instancenorm_with_running_statistics():
    brn = norm_layer("brn", num_accum=1, r_max=3.0, d_max=5.0, warmup_steps=0, ramp_steps=0)(4)
    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.InstanceNorm2d(4), nn.GroupNorm(2, 4),
                        nn.InstanceNorm2d(4, track_running_stats=True), brn, DeclaredMeanOverBatch())
    assert [name for name, _ in coupled_layers(net)] == ["1", "4", "5", "6"]
    assert brn.couples_samples is True and norm_layer("in")(4).couples_samples is False  # each norm's declaration
    assert [name for name, _ in coupled_layers(SimpleModel(norm_layer("bn")))] == [f"features.{i}" for i in (1, 5, 9, 13)]
    assert len(coupled_layers(ResNet20(norm_layer("bn")))) == 19
    assert coupled_layers(SimpleModel(norm_layer("gn4"))) == []


def test_chunking_leaves_the_model_untouched_outside_a_step(train_split):
    """Evaluation and PreciseBN's statistics passes run outside the step: they see the layers as built."""
    net = build("bn", 4, 4, float64=False)
    bn = net.features[1]
    chunking = Chunking(net, 4)
    with chunking:
        assert "forward" in vars(bn)
    assert "forward" not in vars(bn) and bn.forward.__func__ is nn.BatchNorm2d.forward


def test_the_engines_by_name():
    net = build("bn", 4, 4, float64=False)
    assert step_function("loop", net, 4) is accumulate
    assert step_function("batched", net, 4).func is accumulate_batched
    with pytest.raises(ValueError, match=r"^accumulate='ghost'; valid: loop, batched, cached$"):
        step_function("ghost", net, 4)
