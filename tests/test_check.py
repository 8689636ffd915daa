"""gaexp/check.py and gaexp-check: one step both ways names what breaks accumulation, and nothing else."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchvision.models import resnet18

from conftest import REPO
from gaexp.batches import to_input
from gaexp.check import BN_ACCUMULATED, BN_REMEDIES, CheckError, check_accumulation
from gaexp.check_cli import run
from gaexp.model import ResNet20, SimpleModel
from gaexp.norms import norm2d


@pytest.fixture(scope="module")
def mnist_batch(train_split):
    """8 real MNIST images as the model takes them, and their labels."""
    return to_input(train_split.images[:8]).contiguous(), train_split.labels[:8]


def batchnorms(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, nn.BatchNorm2d)]


def test_the_cnn_with_batchnorm_is_unsafe_and_its_four_batchnorms_are_named(mnist_batch):
    torch.manual_seed(0)
    model = SimpleModel(partial(norm2d, "bn"))
    report = check_accumulation(model, *mnist_batch, micro_batch=2, num_accum=4)
    assert not report.safe
    assert [c.module for c in report.modules] == batchnorms(model) == ["features.1", "features.5", "features.9",
                                                                         "features.13"]
    assert {c.type for c in report.modules} == {"BatchNorm2d"} and all(c.rel > 1e-3 for c in report.modules)
    assert {b.module for b in report.buffers} == set(batchnorms(model))
    assert {(b.big, b.accumulated) for b in report.buffers if b.name.endswith("num_batches_tracked")} == {("1", "4")}
    assert report.gradient_rel > 0.1 and not report.loss_couples and report.loss_rel < 1e-6
    assert any("bn_microeval" in line for line in report.remedies) and not report.unexplained
    text = str(report)
    assert text.startswith("UNSAFE") and "features.13" in text and "98.41%" in text


@pytest.mark.parametrize("norm", ["gn4", "gn16", "in", "none"])
def test_the_cnn_with_a_batch_free_norm_is_safe(norm, mnist_batch):
    torch.manual_seed(0)
    model = SimpleModel(partial(norm2d, norm))
    report = check_accumulation(model, *mnist_batch, micro_batch=2, num_accum=4)
    assert report.safe, str(report)
    assert report.modules == [] and report.buffers == [] and report.remedies == [] and report.causes == []
    assert report.gradient_rel < report.rtol == pytest.approx(torch.finfo(torch.float32).eps ** 0.5)
    assert not any(t.flagged for t in report.tensors) and len(report.tensors) == len(list(model.parameters()))
    assert str(report).startswith("SAFE")


def test_resnet20_with_batchnorm_names_all_its_19_batchnorms(mnist_batch):
    torch.manual_seed(0)
    model = ResNet20(partial(norm2d, "bn"))
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
    assert report.stochastic == ["drop", ""]  # the module first, then the model's own F.dropout
    assert "random modules, checked with their training flag off: drop" in str(report)


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
    model = SimpleModel(partial(norm2d, "bn")).eval()
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
    (dict(micro_batch=2, num_accum=4, loss=len), "expected loss(outputs, targets) -> scalar tensor"),
    (dict(micro_batch=2, num_accum=4, loss=lambda out, t: out), "returned Tensor (8, 10); expected a scalar"),
    (dict(micro_batch=2, num_accum=4, rtol=0.0), "rtol=0.0; valid: a number > 0"),
])
def test_bad_input_is_one_line_naming_it(call, message, mnist_batch):
    model = SimpleModel(partial(norm2d, "gn4"))
    with pytest.raises(CheckError, match=re.escape(message)) as e:
        check_accumulation(model, *mnist_batch, **call)
    assert "\n" not in str(e.value)


def test_the_remedies_quoted_are_the_figures_of_the_results_document():
    """Each remedy's accuracy, interval and verdict against the true batch, as docs/results.md's ranking on bs1a16."""
    text = (REPO / "docs" / "results.md").read_text()
    section = text[text.index("## The remedies"):text.index("## Fashion-MNIST")]
    rows = {cells[1]: (float(cells[2]), cells[3], cells[4]) for cells in
            (line.split(" | ") for line in section.splitlines() if re.match(r"\| \d+ \| ", line))}
    for choice, _, accuracy, against, verdict in [*BN_REMEDIES, (BN_ACCUMULATED[0], "", *BN_ACCUMULATED[1:])]:
        assert rows[choice] == (accuracy, against, verdict), choice


# --- the command ---------------------------------------------------------------------------------------

def test_the_command_exits_1_and_names_the_layers_in_json():
    done = subprocess.run([sys.executable, "-m", "gaexp.check_cli", "model=simple", "norm=bn", "--json"],
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


@pytest.mark.parametrize("argv,message", [
    (["nosuch.nets:build"], "TARGET='nosuch.nets:build': cannot import 'nosuch.nets'"),
    (["torchvision.models:resnet18", "--input-shape", "3,5"], "the model refuses inputs of shape (2, 3, 5)"),
    (["torchvision.models:resnet18", "--input-shape", "3,x"], "'3,x'; valid: one sample's shape"),
    (["torchvision.models:resnet18", "--loss", "builtins:len"], "must take 2 positional arguments"),
    (["model=simple", "norm=gn4", "--accum", "1"], "--micro-batch 2 --accum 1; valid: b >= 1, k >= 2"),
    (["model=simple", "norm=gn4", "--data", "cifar"], "--data 'cifar'; valid: random, fashion_mnist, mnist"),
    (["model=resnet20", "norm=gn", "norm.groups=32"], "norm.groups=32 does not divide the channels"),
    (["model=simple", "norm=nosuch"], "nosuch"),
    (["model=simple", "--device", "tpu"], "--device 'tpu'; valid: auto, cpu, cuda"),
])
def test_the_command_refuses_bad_input_with_exit_2(argv, message, capsys):
    status, text = run(argv) if "3,x" not in argv else (None, None)
    if status is None:  # argparse's own refusal
        with pytest.raises(SystemExit) as e:
            run(argv)
        status, text = e.value.code, capsys.readouterr().err.strip().splitlines()[-1]
    assert status == 2 and message in text and "\n" not in text, text
