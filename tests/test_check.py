"""gaexp/check/ and gaexp-check: one step both ways names what breaks accumulation, and nothing else."""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchvision.models import resnet18

from conftest import REPO

from gaexp.check import CheckError, NonFiniteError, check_accumulation
from gaexp.check.evidence import BN_ACCUMULATED, BN_REMEDIES
from gaexp.check.cli import BAD_INPUT, SAFE, UNSAFE, _finite, main, run
from gaexp.model import ResNet20, SimpleModel
from gaexp.norms import norm_layer
from gaexp.tools.zoo import truth


@pytest.fixture(scope="module")
def mnist_batch(train_split):
    """8 real MNIST images as the model takes them, and their labels."""
    return train_split.inputs(slice(0, 8)).contiguous(), train_split.labels[:8]


def batchnorms(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, nn.BatchNorm2d)]


def test_the_cnn_with_batchnorm_is_unsafe_and_its_four_batchnorms_are_named(mnist_batch):
    torch.manual_seed(0)
    model = SimpleModel(norm_layer("bn"))
    report = check_accumulation(model, *mnist_batch, micro_batch=2, num_accum=4)
    assert not report.safe
    assert [c.module for c in report.modules] == batchnorms(model) == ["features.1", "features.5", "features.9",
                                                                         "features.13"]
    assert {c.type for c in report.modules} == {"BatchNorm2d"} and all(c.rel > 1e-3 for c in report.modules)
    assert {b.module for b in report.buffers} == set(batchnorms(model))
    assert {(b.big, b.accumulated) for b in report.buffers if b.name.endswith("num_batches_tracked")} == {("1", "4")}
    assert report.gradient_rel > 0.1 and not report.loss_couples and report.loss_rel < 1e-6
    assert not report.unexplained and not any("norm=" in line for line in report.remedies)  # a model of one's own
    assert any(line.strip().startswith("nn.GroupNorm(16, C) in place of each BatchNorm2d: 97.31%")
               for line in report.remedies)
    assert not any("total count" in line or "in-batch" in line for line in report.remedies)  # not the loss's
    text = str(report)
    assert text.startswith("UNSAFE") and "features.13" in text and "98.41%" in text


def test_a_gaexp_model_is_told_gaexps_norm_choices(mnist_batch):
    torch.manual_seed(0)
    report = check_accumulation(SimpleModel(norm_layer("bn")), *mnist_batch, micro_batch=2, num_accum=4,
                                norm_choices=True)
    assert [line.split(":")[0].strip() for line in report.remedies[1:]] == [
        f"norm={choice}" for choice, *_ in BN_REMEDIES]
    assert report.remedies[1] == ("  norm=bn_microeval: evaluate with each micro-batch's own statistics, as it "
                                  "trained: 98.41%, +0.77 [+0.64, +0.90], better")  # what each changes: its norm's word


@pytest.mark.parametrize("norm", ["gn4", "gn16", "in", "none"])
def test_the_cnn_with_a_batch_free_norm_is_safe(norm, mnist_batch):
    torch.manual_seed(0)
    model = SimpleModel(norm_layer(norm))
    report = check_accumulation(model, *mnist_batch, micro_batch=2, num_accum=4)
    assert report.safe, str(report)
    assert report.modules == [] and report.buffers == [] and report.remedies == [] and report.causes == []
    assert report.gradient_rel < report.rtol == pytest.approx(torch.finfo(torch.float32).eps ** 0.5)
    assert not any(t.flagged for t in report.tensors) and len(report.tensors) == len(list(model.parameters()))
    assert str(report).startswith("SAFE")


def test_resnet20_with_batchnorm_names_all_its_19_batchnorms(mnist_batch):
    torch.manual_seed(0)
    model = ResNet20(norm_layer("bn"))
    report = check_accumulation(model, *mnist_batch, micro_batch=2, num_accum=4)
    assert not report.safe and [c.module for c in report.modules] == batchnorms(model) and len(batchnorms(model)) == 19


def test_torchvision_resnet18_unchanged_names_its_20_batchnorms():
    torch.manual_seed(0)
    model = resnet18()
    inputs, targets = torch.rand(8, 3, 64, 64), torch.randint(0, 1000, (8,))
    report = check_accumulation(model, inputs, targets, micro_batch=2, num_accum=4)
    assert not report.safe and [c.module for c in report.modules] == batchnorms(model) and len(report.modules) == 20
    assert "layer4.0.downsample.1" in [c.module for c in report.modules]


class Tagger(nn.Module):
    """A per-token classifier: token ids (N, T) -> logits (N, T, V)."""

    def __init__(self, vocab: int = 11) -> None:
        super().__init__()
        self.embed, self.out = nn.Embedding(vocab, 16), nn.Linear(16, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.embed(tokens)))


def token_mean(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean over the valid tokens of the micro-batch: the count varies between micro-batches."""
    return F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100)


def token_mean_of_the_step(logits: torch.Tensor, labels: torch.Tensor, step_targets: torch.Tensor) -> torch.Tensor:
    """The same mean, normalized by the count of valid tokens over the whole step."""
    summed = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="sum")
    return summed / (step_targets != -100).sum()


@pytest.fixture
def tokens():
    """8 sequences of 12 tokens, padded after lengths 1 to 12 (-100: not a label)."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 11, (8, 12), generator=generator)
    labels = torch.randint(0, 11, (8, 12), generator=generator)
    lengths = torch.tensor([1, 12, 3, 9, 2, 11, 5, 6])
    labels[torch.arange(12)[None, :] >= lengths[:, None]] = -100
    return ids, labels


def test_a_token_mean_loss_is_a_loss_coupling_with_no_module_named(tokens):
    torch.manual_seed(0)
    report = check_accumulation(Tagger(), *tokens, token_mean, micro_batch=2, num_accum=4)
    assert not report.safe and report.loss_couples and report.loss_rel > 0.05 and report.gradient_rel > 0.05
    assert report.modules == [] and report.buffers == [] and not report.unexplained
    assert any("total count" in line for line in report.remedies) and "1/4" in report.loss


def test_the_same_loss_normalized_by_the_steps_count_is_safe(tokens):
    torch.manual_seed(0)
    report = check_accumulation(Tagger(), *tokens, token_mean_of_the_step, micro_batch=2, num_accum=4)
    assert report.safe, str(report)
    assert report.loss_rel < 1e-6 and "step_targets" in report.loss


def test_in_batch_negatives_couple_through_the_loss_even_given_the_step():
    def contrastive(embeddings: torch.Tensor, targets: torch.Tensor, step_targets: torch.Tensor) -> torch.Tensor:
        logits = embeddings @ embeddings.T  # every other sample of the batch is a negative
        return F.cross_entropy(logits, torch.arange(len(embeddings))) * len(embeddings) / len(step_targets)

    torch.manual_seed(0)
    report = check_accumulation(nn.Linear(6, 4), torch.rand(8, 6), torch.zeros(8), contrastive, micro_batch=2,
                                num_accum=4)
    assert not report.safe and report.loss_couples and report.modules == []
    assert any("in-batch negatives" in line for line in report.remedies)


class Dropouts(nn.Module):
    """No normalization; dropout as a module and as F.dropout in a forward."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden, self.drop, self.fc = nn.Linear(20, 32), nn.Dropout(0.5), nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.dropout(self.drop(torch.relu(self.hidden(x))), 0.3, self.training))


def test_dropout_without_normalization_is_safe_and_said_to_run_without_randomness():
    torch.manual_seed(0)
    model = Dropouts()
    report = check_accumulation(model, torch.rand(8, 20), torch.randint(0, 3, (8,)), micro_batch=2, num_accum=4)
    assert report.safe, str(report)
    assert [(m.module, m.type, m.found) for m in report.stochastic] == [  # the module first, then the model's own
        ("drop", "Dropout", "draws from torch's random stream"), ("", "Dropouts", "draws from torch's random stream")]
    assert "1 Dropout, 1 Dropouts (draws from torch's random stream): drop, (the model)" in str(report)


class BatchCentered(nn.Module):
    """A coupling written in a parent's forward (x - x.mean over the batch), its children per-sample."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(5, 8), nn.ReLU())
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return self.head(h - h.mean(dim=0, keepdim=True))


def test_a_coupling_in_a_forward_names_that_module_not_its_children():
    torch.manual_seed(0)
    report = check_accumulation(nn.Sequential(BatchCentered()), torch.rand(8, 5), torch.randint(0, 2, (8,)),
                                micro_batch=2, num_accum=4)
    assert [(c.module, c.type) for c in report.modules] == [("0", "BatchCentered")] and not report.safe


def test_the_model_is_left_as_it_was(mnist_batch):
    torch.manual_seed(0)
    model = SimpleModel(norm_layer("bn")).eval()
    model.features[0].weight.grad = torch.ones_like(model.features[0].weight)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    before_rng = torch.get_rng_state()
    check_accumulation(model, *mnist_batch, micro_batch=2, num_accum=4)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert torch.equal(model.features[0].weight.grad, torch.ones_like(model.features[0].weight))
    assert all(p.grad is None for n, p in model.named_parameters() if n != "features.0.weight")
    assert not any(m.training for m in model.modules()) and torch.equal(torch.get_rng_state(), before_rng)


@pytest.mark.parametrize("call,message", [
    (dict(micro_batch=2, num_accum=3), "expected micro_batch * num_accum = 2 * 3 = 6 rows"),
    (dict(micro_batch=8, num_accum=1), "num_accum=1; valid: an integer >= 2"),
    (dict(micro_batch=0, num_accum=4), "micro_batch=0; valid: an integer >= 1"),
    (dict(micro_batch=2, num_accum=4, loss=len), "expected loss(outputs, targets), loss(outputs, targets, "
                                                 "step_targets), loss(outputs, targets, *, step_targets) or "
                                                 "loss(outputs, targets, num_items_in_batch) -> scalar tensor, or "
                                                 "'model' (the model's own)"),
    (dict(micro_batch=2, num_accum=4, loss="models"), "loss='models'; expected loss(outputs, targets)"),
    (dict(micro_batch=2, num_accum=4, num_items_in_batch=True), "num_items_in_batch given, and loss cross_entropy "
                                                                "takes no num_items_in_batch parameter: give "
                                                                "loss='model'"),
    (dict(micro_batch=2, num_accum=4, loss=lambda out, t, *, weight: out), "expected loss(outputs, targets)"),
    (dict(micro_batch=2, num_accum=4, modes="eval"), "modes='eval'; valid: train, keep"),
    (dict(micro_batch=2, num_accum=4, loss=lambda out, t: out), "returned Tensor (8, 10); expected a scalar"),
    (dict(micro_batch=2, num_accum=4, rtol=0.0), "rtol=0.0; valid: a number > 0"),
])
def test_bad_input_is_one_line_naming_it(call, message, mnist_batch):
    model = SimpleModel(norm_layer("gn4"))
    with pytest.raises(CheckError, match=re.escape(message)) as e:
        check_accumulation(model, *mnist_batch, **call)
    assert "\n" not in str(e.value)


def test_the_remedies_quoted_are_the_figures_of_the_results_document():
    """Each remedy's accuracy, interval and verdict against the true batch, as docs/results.md's ranking on bs1a16."""
    text = (REPO / "docs" / "results.md").read_text()
    section = text[text.index("## The remedies"):text.index("## Fashion-MNIST")]
    rows = {cells[1]: (float(cells[2]), cells[3], cells[4]) for cells in
            (line.split(" | ") for line in section.splitlines() if re.match(r"\| \d+ \| ", line))}
    for choice, accuracy, against, verdict in [*BN_REMEDIES, BN_ACCUMULATED]:
        assert rows[choice] == (accuracy, against, verdict), choice


# --- the command ---------------------------------------------------------------------------------------

def test_the_command_exits_1_and_names_the_layers_in_json():
    done = subprocess.run([sys.executable, "-m", "gaexp.check", "model=simple", "norm=bn", "--json"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    assert report["safe"] is False and report["target"] == "model=simple norm=bn"
    assert [c["module"] for c in report["modules"]] == ["features.1", "features.5", "features.9", "features.13"]


def test_the_command_is_safe_on_mnist_for_group_norm(data_root):
    status, text = run(["model=simple", "norm=gn4", "--data", "mnist", "--data-root", str(data_root)])
    assert status == 0 and text.splitlines()[1].startswith("SAFE: micro-batch 2 x 4"), text
    assert "mnist's first 8 training images" in text.splitlines()[0]


def test_the_command_takes_the_regime_and_an_import_path():
    status, text = run(["model=resnet20", "norm=bn", "regime=bs4a4"])
    assert status == 1 and "micro-batch 4 x 4" in text and "modules coupling the samples of a batch: 19" in text
    status, text = run(["torchvision.models:resnet18", "--input-shape", "3,32,32", "--num-classes", "7",
                        "--micro-batch", "3", "--accum", "2"])
    assert status == 1 and "micro-batch 3 x 2" in text and "modules coupling the samples of a batch: 20" in text


def test_replicas_read_as_accumulation_over_all_their_micro_batches():
    """w replicas of b with k steps each, norms per replica, is the check at b with w*k steps: --replicas, or a DP
    regime's own; its reading said in one line before the verdict, and the verdict that of (b, w*k)."""
    status, text = run(["model=simple", "norm=bn", "regime=w2b4a2", "--json"])
    report = json.loads(text)
    assert status == UNSAFE and (report["replicas"], report["micro_batch"], report["num_accum"]) == (2, 4, 4)
    status, text = run(["torchvision.models:squeezenet1_1", "--input-shape", "3,32,32", "--micro-batch", "2",
                        "--accum", "3", "--replicas", "2"])
    assert status == SAFE and text.splitlines()[1] == (
        "data parallelism: 2 replicas x micro-batch 2 x 3 steps each, norms per replica, is accumulation at "
        "micro-batch 2 x 6 steps: checked below (synchronized norms, nn.SyncBatchNorm, span the replicas' "
        "micro-batches and are not)")
    assert text.splitlines()[2].startswith("SAFE: micro-batch 2 x 6 accumulation steps against one batch of 12")
    status, text = run(["model=simple", "norm=gn4", "regime=bs4a4"])
    assert status == SAFE and "data parallelism" not in text


@pytest.mark.parametrize("argv,message", [
    (["nosuch.nets:build"], "TARGET='nosuch.nets:build': cannot import 'nosuch.nets'"),
    (["model=simple", "norm=gn4", "--replicas", "0"], "--replicas 0; valid: a positive integer (1: no data "
                                                      "parallelism)"),
    (["torchvision.models:resnet18", "--input-shape", "3,5"], "the model refuses inputs of shape (2, 3, 5)"),
    (["torchvision.models:resnet18", "--input-shape", "3,x"], "'3,x'; valid: one sample's shape"),
    (["torchvision.models:resnet18", "--loss", "builtins:len"], "--loss='builtins:len': expected loss(outputs, "
                                                               "targets), loss(outputs, targets, step_targets), "),
    (["torchvision.models:resnet18", "--micro-batch", "two"], "argument --micro-batch: invalid int value: 'two' "
                                                            "(gaexp-check --help lists the options)"),
    ([], "the following arguments are required: TARGET"),
    (["model=simple", "norm=gn4", "--accum", "1"], "--micro-batch 2 --accum 1; valid: b >= 1, k >= 2"),
    (["model=simple", "norm=gn4", "--data", "cifar"], "--data 'cifar'; valid: random, cifar10, cifar100, custom, fashion_mnist, imagefolder, mnist, svhn"),
    (["model=resnet20", "norm=gn", "norm.groups=32"], "norm.groups=32 does not divide the channels"),
    (["model=simple", "norm=nosuch"], "nosuch"),
    (["model=simple", "--device", "tpu"], "--device 'tpu'; valid: auto, cpu, cuda"),
])
def test_the_command_refuses_bad_input_with_exit_2(argv, message, capsys):
    status, text = run(argv)  # argparse's own refusals too: one line, no usage
    assert status == 2 and message in text and "\n" not in text, text
    assert capsys.readouterr().err == ""


# --- stock models: no false alarm, no miss, the same verdict at every seed ---------------------------------

@pytest.mark.parametrize("builder", ["convnext_tiny", "efficientnet_b0", "mobilenet_v3_small", "squeezenet1_1"])
def test_a_stock_model_gets_the_truth_at_every_seed(builder):
    """ConvNeXt (LayerNorm, stochastic depth behind a 1e-6 layer scale), EfficientNet (BatchNorm, stochastic
    depth, dropout), MobileNet (BatchNorm, dropout), SqueezeNet (no normalization, dropout): unsafe exactly when a
    BatchNorm trains, naming exactly those, whatever the seed; every random module found and said."""
    import torchvision.models

    for seed in (0, 1, 2):
        torch.manual_seed(seed)
        model = torchvision.models.get_model(builder)
        generator = torch.Generator().manual_seed(seed)
        inputs, targets = torch.rand(8, 3, 32, 32, generator=generator), torch.randint(0, 1000, (8,), generator=generator)
        report = check_accumulation(model, inputs, targets, micro_batch=2, num_accum=4, seed=seed)
        expected = truth(model)  # the zoo's truth: the BatchNorms in training mode
        assert report.safe == (not expected) and [c.module for c in report.modules] == expected, (builder, seed, str(report))
        randoms = {m.type for m in report.stochastic}
        assert randoms == {"convnext_tiny": {"StochasticDepth"}, "efficientnet_b0": {"StochasticDepth", "Dropout"},
                           "mobilenet_v3_small": {"Dropout"}, "squeezenet1_1": {"Dropout"}}[builder]
        assert not report.untested and not report.unexplained and not report.loss_couples


def test_dropout_behind_a_zero_head_is_found_and_a_vit_is_safe():
    """torchvision's VisionTransformer starts its head at zero: the output does not move with the seed, yet its
    dropout and attention dropout are found (by the draws of their own code) and not named as couplings."""
    from torchvision.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32,
                              dropout=0.1, attention_dropout=0.1, num_classes=10)
    assert not model.heads.head.weight.any()
    report = check_accumulation(model, torch.rand(8, 3, 32, 32), torch.randint(0, 10, (8,)), micro_batch=2,
                                num_accum=4)
    assert report.safe and report.modules == [], str(report)
    assert {(m.type, m.found) for m in report.stochastic} == {
        ("Dropout", "draws from torch's random stream"), ("MultiheadAttention", "draws from torch's random stream")}
    assert sum(m.type == "MultiheadAttention" for m in report.stochastic) == 2


class RareDropPath(nn.Module):
    """Drop-path written in the block's own forward, with a probability so small that two seeds draw the same
    (all-keep) mask, behind a 1e-6 layer scale: invisible at the output, found by its draw."""

    def __init__(self, p: float = 1e-9) -> None:
        super().__init__()
        self.fc, self.p, self.scale = nn.Linear(6, 6), p, nn.Parameter(torch.full((6,), 1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = (torch.rand(x.shape[0], 1) >= self.p).to(x) if self.training else 1.0
        return x + keep * self.scale * self.fc(x)


def test_a_drop_path_in_a_forward_is_found_whatever_its_probability_and_effect():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), RareDropPath(), nn.Linear(6, 3))
    for seed in (0, 1, 2):
        report = check_accumulation(model, torch.rand(8, 4), torch.randint(0, 3, (8,)), micro_batch=2, num_accum=4,
                                    seed=seed)
        assert report.safe and [(m.module, m.type) for m in report.stochastic] == [("1", "RareDropPath")]


class GeneratorNoise(nn.Module):
    """Random through a generator of its own: the global streams never move, its output does."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (torch.rand(x.shape, generator=self.generator) > 0.2) if self.training else x


def test_a_module_random_through_its_own_generator_is_found_by_its_output():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), GeneratorNoise(), nn.Linear(6, 3))
    report = check_accumulation(model, torch.rand(8, 4), torch.randint(0, 3, (8,)), micro_batch=2, num_accum=4)
    assert report.safe and [(m.module, m.found) for m in report.stochastic] == [
        ("1", "its output varies between two calls on the same input")]


# --- the batch axis, traced -----------------------------------------------------------------------------------

class SequenceFirst(nn.Module):
    """Batch-first inputs (N, T, 5), a sequence-first encoder inside (batch_first=False: (T, N, E))."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(5, 16), nn.Linear(16, 3)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=False)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x).transpose(0, 1)).transpose(0, 1).mean(1))


@pytest.mark.parametrize("length", [8, 5])
def test_a_sequence_first_encoder_is_split_along_its_batch_axis(length):
    """At a sequence length of b*k = 8 the encoder's first axis is as long as the batch: it is still split
    along its second, and tested (not named, not untested), as at any other length."""
    torch.manual_seed(0)
    model = SequenceFirst()
    report = check_accumulation(model, torch.rand(8, length, 5), torch.randint(0, 3, (8,)), micro_batch=2,
                                num_accum=4)
    assert report.safe and report.modules == [] and report.untested == [], str(report)


class PositionTable(nn.Module):
    """A table of positions that has no batch axis (8 rows, as many as the batch), mixed over its rows."""

    def __init__(self) -> None:
        super().__init__()
        self.positions, self.mix = nn.Embedding(8, 4), nn.Softmax(dim=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = self.mix(self.positions(torch.arange(8)))  # (8, 4): rows are positions, not samples
        return x + table.sum(0)


def test_a_module_without_a_batch_axis_is_untested_never_coupling():
    torch.manual_seed(0)
    model = nn.Sequential(PositionTable(), nn.Linear(4, 3))
    report = check_accumulation(model, torch.rand(8, 4), torch.randint(0, 3, (8,)), micro_batch=2, num_accum=4)
    assert report.safe and report.modules == [], str(report)
    assert report.untested == ["0.positions", "0.mix"]
    assert "modules whose tensors carry no batch axis, not tested: 2: 0.positions, 0.mix" in str(report)


class Cache:
    """A KV cache as transformers' DynamicCache behaves: each layer's call appends its keys, along the sequence, to
    what the cache holds for that layer, and attends over all of it."""

    def __init__(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}

    def update(self, layer: int, keys: torch.Tensor) -> torch.Tensor:
        self.keys[layer] = keys if layer not in self.keys else torch.cat([self.keys[layer], keys], dim=1)
        return self.keys[layer]


class CachedLayer(nn.Module):
    def __init__(self, layer: int) -> None:
        super().__init__()
        self.layer, self.proj = layer, nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, cache: Cache) -> torch.Tensor:
        keys = cache.update(self.layer, self.proj(x))  # (b, T, 4): the batch first, as the cache's tensors
        return x + keys.softmax(-1)[:, -x.shape[1]:]


class CachedDecoder(nn.Module):
    """Two layers handed one cache object, as a decoder with use_cache=True hands its attention layers."""

    def __init__(self) -> None:
        super().__init__()
        self.layers, self.head = nn.ModuleList([CachedLayer(0), CachedLayer(1)]), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cache = Cache()
        for layer in self.layers:
            x = layer(x, cache)
        return self.head(x.mean(1))


def test_a_cache_handed_to_layers_is_copied_for_each_call_again_never_a_crash():
    """Calling a layer again with the object its first call appended to raised 'Sizes of tensors must match'
    (GPT-2, Llama and Mixtral with their default use_cache=True); each call now gets a copy of the cache as the layer
    first saw it, and every layer is tested."""
    torch.manual_seed(0)
    report = check_accumulation(CachedDecoder(), torch.rand(8, 5, 4), torch.randint(0, 3, (8,)), micro_batch=2,
                                num_accum=4)
    assert report.safe and report.untested == [] and report.untested_why == {}, str(report)
    assert report.gradient_rel < 1e-5


class Locked:
    """An argument nothing can copy (a handle of the user's)."""

    def __deepcopy__(self, memo: dict) -> "Locked":
        raise TypeError("cannot copy a lock")


class TakesHandle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, handle: Locked) -> torch.Tensor:
        return self.proj(x)


class WithHandle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner, self.head = TakesHandle(), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(x, Locked()))


def test_a_module_that_cannot_be_called_again_is_untested_with_the_reason_and_the_verdict_stands():
    torch.manual_seed(0)
    report = check_accumulation(WithHandle(), torch.rand(8, 4), torch.randint(0, 3, (8,)), micro_batch=2,
                                num_accum=4)
    assert report.safe and report.untested_why == {
        "inner": "its argument of type Locked cannot be copied (TypeError: cannot copy a lock)"}, str(report)
    assert ("modules that could not be called again on a micro-batch, not tested: 1\n  inner: its argument of type "
            "Locked cannot be copied (TypeError: cannot copy a lock)") in str(report)


class FailingBackward(torch.autograd.Function):
    """The identity, whose backward raises: a failure outside any forward, inside the check's step."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("no gradient through here\nsecond line")


class BackwardFails(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return FailingBackward.apply(self.proj(x))


def test_a_failure_in_the_checks_own_steps_is_one_line_naming_the_phase_and_where():
    with pytest.raises(CheckError) as e:
        check_accumulation(BackwardFails(), torch.rand(8, 4), torch.randint(0, 3, (8,)), micro_batch=2, num_accum=4)
    assert str(e.value).startswith("the check failed in the step as one batch: RuntimeError in backward "
                                   "(test_check.py, line ") and str(e.value).endswith(": no gradient through here")
    code, text = run(["test_check:BackwardFails", "--input-shape", "4"])
    assert code == BAD_INPUT and text.startswith("gaexp-check: error: the check failed in the step as one batch")


# --- non-finite steps are never safe ---------------------------------------------------------------------------

class SqrtOfZero(nn.Module):
    """A finite forward (sqrt(0) = 0) whose gradient is NaN (inf * 0)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.sqrt(x - x)


class LogOfNegative(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x - 2.0)


class LogIntoLinear(nn.Module):
    """NaN made by its own forward, then passed through a child: the NaN is this module's, not the child's."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.log(x - 2.0))


@pytest.mark.parametrize("model,loss,where", [
    (nn.Linear(4, 3), lambda out, t: out.sum() * float("nan"), "the loss is nan on the whole batch, its outputs finite"),
    (nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Identity(), LogOfNegative()), nn.Linear(4, 3)), None,
     "nan first appears in the output of 1.1 (LogOfNegative) in the forward of the whole batch"),
    (nn.Sequential(nn.Linear(4, 4), LogIntoLinear(), nn.Linear(4, 3)), None,
     "nan first appears in the output of 1 (LogIntoLinear) in the forward of the whole batch"),
    (nn.Sequential(nn.Linear(4, 4), SqrtOfZero(), nn.Linear(4, 3)), None,
     "the gradient of 0.weight is nan after the step of the whole batch, the loss finite"),
])
def test_nan_anywhere_ends_the_check_naming_where_it_first_appeared(model, loss, where):
    torch.manual_seed(0)
    with pytest.raises(NonFiniteError) as e:
        check_accumulation(model, torch.rand(8, 4), torch.randint(0, 3, (8,)), loss, micro_batch=2, num_accum=4)
    assert e.value.where == where


def test_a_loss_that_is_nan_only_on_a_micro_batch_is_named_with_its_rows(tokens):
    """The token mean of a micro-batch with no valid token is 0/0."""
    ids, labels = tokens
    labels[2:4] = -100
    torch.manual_seed(0)
    with pytest.raises(NonFiniteError, match=re.escape("the loss is nan on micro-batch 2 of 4 (rows 2:4)")):
        check_accumulation(Tagger(), ids, labels, token_mean, micro_batch=2, num_accum=4)


def test_the_command_exits_3_on_nan_with_json_numbers(tmp_path, monkeypatch):
    (tmp_path / "nanloss.py").write_text("def loss(outputs, targets):\n    return outputs.sum() * float('nan')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    status, text = run(["torchvision.models:squeezenet1_1", "--input-shape", "3,32,32", "--loss", "nanloss:loss"])
    assert status == 3 and text.splitlines()[1] == ("NON-FINITE: the loss is nan on the whole batch, its outputs "
                                                    "finite; the step is not safe to train, with or without "
                                                    "accumulation"), text
    status, text = run(["torchvision.models:squeezenet1_1", "--input-shape", "3,32,32", "--loss", "nanloss:loss",
                        "--json"])
    report = json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
    assert status == 3 and report["verdict"] == "non-finite" and report["safe"] is False


def test_json_has_numbers_and_null_for_what_is_not_finite():
    assert _finite({"a": math.inf, "b": [math.nan, 1.5], "c": "x"}) == {"a": None, "b": [None, 1.5], "c": "x"}
    status, text = run(["torchvision.models:squeezenet1_1", "--input-shape", "3,32,32", "--json"])
    report = json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
    assert status == 0 and report["verdict"] == "safe" and isinstance(report["gradient_rel"], float)


# --- one loss contract ------------------------------------------------------------------------------------------

def step_mean_positional(logits: torch.Tensor, labels: torch.Tensor, step_targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels, reduction="sum") / len(step_targets)


def step_mean_keyword(logits: torch.Tensor, labels: torch.Tensor, *, step_targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels, reduction="sum") / len(step_targets)


def step_mean_third(logits: torch.Tensor, labels: torch.Tensor, everything: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels, reduction="sum") / len(everything)


@pytest.mark.parametrize("loss", [step_mean_positional, step_mean_keyword, step_mean_third])
def test_both_forms_of_the_step_loss_are_one_contract_for_the_api_and_the_command(loss, tmp_path, monkeypatch):
    torch.manual_seed(0)
    report = check_accumulation(nn.Linear(4, 3), torch.rand(8, 4), torch.randint(0, 3, (8,)), loss, micro_batch=2,
                                num_accum=4)
    assert report.safe and "given the step's targets" in report.loss and report.loss_rel < 1e-6
    (tmp_path / "steploss.py").write_text(
        "import torch.nn.functional as F\n\n"
        "def positional(logits, labels, step_targets):\n"
        "    return F.cross_entropy(logits, labels, reduction='sum') / len(step_targets)\n\n"
        "def keyword(logits, labels, *, step_targets):\n"
        "    return F.cross_entropy(logits, labels, reduction='sum') / len(step_targets)\n\n"
        "def third(logits, labels, everything):\n"
        "    return F.cross_entropy(logits, labels, reduction='sum') / len(everything)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    form = {step_mean_positional: "positional", step_mean_keyword: "keyword", step_mean_third: "third"}[loss]
    status, text = run(["torchvision.models:squeezenet1_1", "--input-shape", "3,32,32", "--loss", f"steploss:{form}"])
    assert status == 0 and f"loss: {form}, given the step's targets (step_targets), not scaled" in text, text


def test_loss_remedies_fit_the_cause(tokens):
    """A per-micro-batch count is fixed by the step's count; samples compared with each other are not."""
    torch.manual_seed(0)
    count = check_accumulation(Tagger(), *tokens, token_mean, micro_batch=2, num_accum=4)
    assert count.loss_coupling == "count" and len(count.remedies) == 1 and "total count" in count.remedies[0]

    def contrastive(embeddings: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(embeddings @ embeddings.T, torch.arange(len(embeddings)))

    pairs = check_accumulation(nn.Linear(6, 4), torch.rand(8, 6), torch.zeros(8), contrastive, micro_batch=2,
                               num_accum=4)
    assert pairs.loss_coupling == "samples" and len(pairs.remedies) == 1 and "in-batch" in pairs.remedies[0]


# --- the mode, and the command's words ------------------------------------------------------------------------

def test_the_mode_is_stated_and_the_users_modes_can_be_kept():
    torch.manual_seed(0)
    model = resnet18(num_classes=10)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.eval()  # frozen statistics: per sample
    inputs, targets = torch.rand(8, 3, 32, 32), torch.randint(0, 10, (8,))
    trained = check_accumulation(model, inputs, targets, micro_batch=2, num_accum=4)
    assert not trained.safe and trained.mode == "train" and trained.eval_modules == batchnorms(model)
    assert "mode: training, every module (the model came with 20 in eval mode: bn1, layer1.0.bn1" in str(trained)
    kept = check_accumulation(model, inputs, targets, micro_batch=2, num_accum=4, modes="keep")
    assert kept.safe and kept.mode == "keep", str(kept)
    assert all(not m.training for m in model.modules() if isinstance(m, nn.BatchNorm2d))  # left as it came
    assert model.training


def test_the_command_keeps_the_modes_when_asked(tmp_path, monkeypatch):
    (tmp_path / "frozen.py").write_text(
        "from torch import nn\nfrom torchvision.models import resnet18\n\n"
        "def build():\n    model = resnet18(num_classes=10)\n"
        "    for m in model.modules():\n        if isinstance(m, nn.BatchNorm2d):\n            m.eval()\n"
        "    return model\n\n"
        "def needs(depth):\n    return nn.Linear(2, 2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    status, text = run(["frozen:build", "--input-shape", "3,32,32", "--keep-modes"])
    assert status == 0 and "mode: the model's own training flags (20 modules in eval mode" in text, text
    status, text = run(["frozen:build", "--input-shape", "3,32,32"])
    assert status == 1 and "--keep-modes" in text.splitlines()[2], text
    status, text = run(["frozen:needs"])
    assert status == 2 and text == ("gaexp-check: error: TARGET='frozen:needs': needs(depth) must be callable with no "
                                    "arguments (missing a required argument: 'depth')")


def test_a_model_whose_state_needs_its_metadata_is_given_back_in_place():
    """MNASNet refuses a state dict without its version metadata: the check copies its state back in place."""
    from torchvision.models import mnasnet0_5

    torch.manual_seed(0)
    model = mnasnet0_5()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    report = check_accumulation(model, torch.rand(8, 3, 32, 32), torch.randint(0, 1000, (8,)), micro_batch=2,
                                num_accum=4)
    assert not report.safe and [c.module for c in report.modules] == truth(model)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_the_console_script_imports_a_loss_from_the_folder_it_runs_in(tmp_path):
    """As docs/check.md runs it: mynets.py in the current folder, `gaexp-check ... --loss mynets:nan_loss`."""
    (tmp_path / "mynets.py").write_text("def nan_loss(outputs, targets): return outputs.sum() * float('nan')\n")
    script = Path(sys.executable).parent / "gaexp-check"
    done = subprocess.run([str(script), "torchvision.models:squeezenet1_1", "--input-shape", "3,32,32", "--loss",
                           "mynets:nan_loss"], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert done.returncode == 3 and done.stdout.splitlines()[1].startswith("NON-FINITE: the loss is nan"), done.stderr


def test_the_data_is_found_where_the_studys_commands_put_it(data_root, monkeypatch, tmp_path):
    """No --data-root: a gaexp model's dataset is the config's data.root, ${paths.outputs}/data, as for `gaexp`."""
    if data_root.name != "data":
        pytest.skip(f"the test data root {data_root} is not a paths.outputs/data")
    monkeypatch.chdir(tmp_path)
    status, text = run(["model=simple", "norm=gn4", "--data", "mnist", f"paths.outputs={data_root.parent}"])
    assert status == SAFE and "mnist's first 8 training images" in text
    status, text = run(["model=simple", "norm=gn4", "--data", "mnist"])  # outputs/data of this empty folder
    assert status == BAD_INPUT and f"not found under {tmp_path}/outputs/data" in text


# --- the user's own code: broken files are bad input, a gaexp builder is told its command -------------------

BROKEN = {  # module text -> what the one line says, and where
    "import torch\ndef build():\n    return torch.nn.Linear(3, 4\n":
        "cannot import '{m}': SyntaxError at {m}.py, line 3: '(' was never closed",
    "import torch\n\nraise RuntimeError('no weights here')\n":
        "cannot import '{m}': RuntimeError at {m}.py, line 3: no weights here",
    "from torch import nn\n\n\ndef build():\n    return nn.Linear(3)\n":
        "calling it with no arguments raised TypeError at {m}.py, line 5: Linear.__init__() missing 1 required",
}


@pytest.mark.parametrize("number,text", enumerate(BROKEN))
def test_a_broken_user_module_is_bad_input_naming_its_file_and_line(number, text, tmp_path, monkeypatch):
    """Exit status 2, never 1 (unsafe): a CI gate must not read a broken file as an unsafe model."""
    module = f"broken_{number}_nets"
    (tmp_path / f"{module}.py").write_text(text)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    status, line = run([f"{module}:build"])
    assert status == BAD_INPUT and line.startswith(f"gaexp-check: error: TARGET='{module}:build': "
                                                   + BROKEN[text].format(m=module)) and "\n" not in line, line


def test_a_broken_gaexp_model_names_model_target_its_file_and_line(tmp_path, monkeypatch):
    (tmp_path / "broken_custom_nets.py").write_text("import torch\n\ndef build(norm_layer, in_channels, num_classes)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    status, line = run(["model=custom", "model.target=broken_custom_nets:build", "norm=gn4"])
    assert status == BAD_INPUT and line == ("gaexp-check: error: model.target='broken_custom_nets:build': cannot "
                                            "import 'broken_custom_nets': SyntaxError at broken_custom_nets.py, "
                                            "line 3: expected ':'"), line


GAEXP_BUILDER = """from torch import nn


def build(norm_layer, in_channels, num_classes):
    return nn.Sequential(nn.Conv2d(in_channels, 24, 3, padding=1), norm_layer(24), nn.ReLU(),
                         nn.Conv2d(24, 32, 3, padding=1), norm_layer(32), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, num_classes))
"""


def test_a_gaexp_builder_given_as_an_import_path_is_told_the_command_that_works(tmp_path, monkeypatch, capsys):
    """The hint runs as printed (through the console script's main, in the folder the user is in), and so does
    the GroupNorm remedy it prints for 24 and 32 channels, where 16 groups would be refused."""
    (tmp_path / "hint_nets.py").write_text(GAEXP_BUILDER)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # main puts the current folder on it, as the script does
    with pytest.raises(SystemExit) as done:
        main(["hint_nets:build"])
    line = capsys.readouterr().err.strip()
    assert done.value.code == BAD_INPUT and line.startswith(
        "gaexp-check: error: TARGET='hint_nets:build': build(norm_layer, in_channels, num_classes) is a gaexp model "
        "builder (it takes norm_layer=, in_channels=, num_classes=)"), line
    command = shlex.split(line.partition("check it as gaexp builds it: ")[2])
    assert command[0] == "gaexp-check" and "model.target=hint_nets:build" in command
    with pytest.raises(SystemExit) as done:
        main(command[1:])
    out = capsys.readouterr().out
    assert done.value.code == UNSAFE and out.startswith("gaexp-check model=custom norm=bn"), out
    remedy = next(row.strip() for row in out.splitlines() if "GroupNorm" in row)
    assert remedy.startswith("norm=gn norm.groups=8: GroupNorm with 8 groups instead (the study measured 16, which "
                             "does not divide the model's 24 channels): 97.31%"), remedy
    status, text = run(["model=custom", "model.target=hint_nets:build", *remedy.partition(":")[0].split()])
    assert status == SAFE, text


def test_the_groupnorm_remedy_names_a_group_count_that_divides_each_layer():
    """BatchNorms of 12, 24 and 32 channels: 16 groups for 32, 8 for 24, 4 for 12; the layers so replaced build
    (GroupNorm refuses a count that does not divide) and the model is then safe."""
    def model(norm):
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 12, 3), norm(12), nn.Conv2d(12, 24, 3), norm(24), nn.Conv2d(24, 32, 3),
                             norm(32), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))

    inputs, labels = torch.rand(8, 3, 12, 12), torch.randint(0, 10, (8,))
    report = check_accumulation(model(nn.BatchNorm2d), inputs, labels, micro_batch=2, num_accum=4)
    remedy = next(row.strip() for row in report.remedies if "GroupNorm" in row)
    assert remedy.startswith("nn.GroupNorm(16, C) in place of each BatchNorm2d (nn.GroupNorm(8, C) for C = 24; "
                             "nn.GroupNorm(4, C) for C = 12: 16 groups must divide C): 97.31%"), remedy
    said = {int(c): int(g) for g, c in re.findall(r"nn.GroupNorm\((\d+), C\) for C = (\d+)", remedy)}
    assert not check_accumulation(model(lambda c: nn.GroupNorm(said.get(c, 16), c)), inputs, labels,
                                  micro_batch=2, num_accum=4).causes


def test_transformers_and_lightning_are_imported_only_by_the_check_of_a_transformers_model():
    """They are optional (gaexp[hf], gaexp[lightning]): the command, the application and the check's package load
    without them."""
    probe = ("import sys, gaexp.app, gaexp.check, gaexp.check.cli; "
             "print(sorted(m for m in ('transformers', 'lightning', 'accelerate') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr


@pytest.mark.parametrize("loss, expected", [("token_mean", UNSAFE), ("step_token_mean", SAFE), ("seq_mean", SAFE)])
def test_gaexps_language_model_gets_the_verdict_its_losss_arithmetic_implies(loss, expected, tmp_path):
    """task=lm on a folder of documents of varied length: the token mean per micro-batch is unsafe, with the remedy
    named as the config's choice and the study's measured effect; the step's count and the per-sequence mean are
    safe."""
    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(12):
        (texts / f"doc{i:02}.txt").write_bytes(bytes(range(97, 100 + 5 * i)))
    status, text = run(["task=lm", "model=gpt", "norm=ln", "data=textfolder", f"data.path={texts}", "data.holdout=2",
                        "data.context=32", f"task.loss={loss}"])
    assert status == expected, text
    assert text.startswith(f"gaexp-check model=gpt task.loss={loss}: data=textfolder's first 8 training sequences")
    if expected == UNSAFE:
        assert "the loss normalises each micro-batch by a count of its own" in text
        assert ("task.loss=step_token_mean: the step's token count (gaexp's language-model study: task.loss=token_mean "
                "at bs1a16, loss per token 2.185 nats, +0.038 [+0.019, +0.057] nats against the true batch of 16, "
                "worse at ±0.02") in text


@pytest.mark.parametrize("balance, expected", [("micro", UNSAFE), ("global", SAFE), ("running", UNSAFE)])
def test_gaexps_mixture_of_experts_gets_the_verdict_its_balancings_arithmetic_implies(balance, expected, tmp_path):
    """model=gpt_moe with its loss over the step's count: the balancing loss over each micro-batch's fractions, or
    over those counted so far, is unsafe, named as the term it is, with the config's remedy and the study's figures;
    over the step's fractions it is the big batch's step."""
    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(12):
        (texts / f"doc{i:02}.txt").write_bytes(bytes(range(97, 100 + 5 * i)))
    status, text = run(["task=lm", "model=gpt_moe", "norm=ln", "data=textfolder", f"data.path={texts}",
                        "data.holdout=2", "data.context=32", "task.loss=step_token_mean", f"task.balance={balance}"])
    assert status == expected, text
    assert text.startswith(f"gaexp-check model=gpt_moe task.loss=step_token_mean task.balance={balance}: ")
    term = re.search(r"^  aux_loss +(over the whole micro-batch|per-sample) +(\S+)$", text, re.M)
    assert term, text
    if expected == SAFE:
        assert term.group(1) == "per-sample" and float(term.group(2)) < 1e-5, text
        return
    assert term.group(1) == "over the whole micro-batch" and float(term.group(2)) > 1e-3, text
    assert "aux_loss is computed over the whole micro-batch" in text and "state carried" not in text
    assert ("task.balance=global: the step's fractions per expert, counted by a pass over the step's routing before "
            "its first backward (gaexp's MoE study: task.balance=micro at bs1a16, loss per token 2.108 nats, +0.004 "
            "[-0.073, +0.081] nats against the true batch of 16, inconclusive (13 seeds) at ±0.02") in text


def test_the_checks_language_model_evidence_is_the_studys_table():
    """The figures the check cites are docs/results.md's, as printed by the language-model study's report."""
    from gaexp.check.evidence import LM_BALANCE, LM_TOKEN_MEAN
    results = (REPO / "docs" / "results.md").read_text()
    choice, regime, loss, against, verdict = LM_TOKEN_MEAN
    diff, ci = against.split(" ", 1)
    assert f"| {choice} | {regime} | {diff} | {ci} | " in results and f"| {verdict} |" in results
    assert f"| {choice} | 2.147 | {loss:.3f} | " in results
    for choice, regime, loss, against, verdict in LM_BALANCE:
        diff, ci = against.split(" ", 1)
        assert f"| {choice} | {regime} | {diff} | {ci} | " in results and f"| {verdict} |" in results
        assert f"| {choice} | 2.104 | {loss:.3f} | " in results


@pytest.mark.parametrize("negatives, norm, expected", [("micro", "gn4", UNSAFE), ("step", "gn4", SAFE),
                                                       ("step", "none", SAFE), ("step", "bn", UNSAFE)])
def test_gaexps_contrastive_model_gets_the_verdict_its_negatives_and_norm_imply(negatives, norm, expected, data_root):
    """task=contrastive on MNIST's views: each micro-batch's own negatives are named as the coupling, with the
    config's remedy (the step's negatives under the cached engine) and the study's figures; the step's negatives, as
    the cached engine computes them, are the big batch's step with a per-sample norm, and with BatchNorm are not,
    BatchNorm named (each micro-batch's statistics, in both passes)."""
    status, text = run([f"model=simple", f"norm={norm}", "task=contrastive", f"task.negatives={negatives}",
                        "--data", "mnist", "--data-root", str(data_root)])
    assert status == expected, text
    assert text.startswith(f"gaexp-check model=simple norm={norm} task=contrastive task.negatives={negatives}: mnist's "
                           "first 8 training images (seed 0), two views each: 16 rows")
    assert "not tested" not in text, text
    if negatives == "micro":
        assert "the loss couples the samples of a batch" in text and "modules coupling the samples of a batch: none" in text
        assert "  task.negatives=step accumulate=cached: the step's negatives, exact at one micro-batch's" in text
        from gaexp.check.evidence import CONTRASTIVE_NEGATIVES
        for row, regime, accuracy, against, verdict in CONTRASTIVE_NEGATIVES:
            assert f"{row} at {regime}, k-NN accuracy {accuracy:.2f}%, {against} points" in text
    elif expected == SAFE:
        assert re.search(r"^gradient: relative difference \S+ over all parameters$", text, re.M), text
        assert "BatchNorm" not in text
    else:
        assert "4 BatchNorm2d modules couple the samples of a batch" in text
        assert "the loss couples" not in text  # the cached step's loss is the big batch's: only BatchNorm differs


def test_the_checks_contrastive_evidence_is_the_studys_table():
    """The figures the check cites are docs/results.md's, as the contrastive study's report printed them."""
    from gaexp.check.evidence import CONTRASTIVE_NEGATIVES
    results = (REPO / "docs" / "results.md").read_text()
    for row, regime, accuracy, against, verdict in CONTRASTIVE_NEGATIVES:
        diff, ci = against.split(" ", 1)
        assert f"| {row} | {regime} | {diff} | {ci} | " in results and f"| {verdict} |" in results
        assert re.search(rf"^\| {row} \| [\d.]+ \| {accuracy:.2f} \|$", results, re.M), row
