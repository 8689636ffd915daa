from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import re

import torch.nn.functional as F
from torchvision.models.resnet import BasicBlock

from gaexp.cell import validated
from gaexp.model import make_model
from gaexp.config import typed
from gaexp.model import ResNet20, SimpleModel, load, norm_channels
from gaexp.targets import TargetError
from gaexp.norms import NORMS, require_channels, norm_layer


def test_registry_keeps_the_study_defaults():
    bn = norm_layer("bn")(32)
    assert isinstance(bn, nn.BatchNorm2d) and bn.affine and bn.momentum == 0.1 and bn.track_running_stats
    inorm = norm_layer("in")(32)
    assert isinstance(inorm, nn.InstanceNorm2d) and not inorm.affine and not inorm.track_running_stats
    assert norm_layer("gn4")(64).num_groups == 4 and norm_layer("gn16")(64).num_groups == 16
    assert norm_layer("gn4")(64).affine
    assert isinstance(norm_layer("none")(8), nn.Identity)
    assert norm_layer("gn", groups=8)(64).num_groups == 8


def test_unknown_norm_lists_valid_names():
    with pytest.raises(ValueError, match=r"norm.name='layernorm'; valid: \['bn', 'bn_kmom', 'bn_microeval', "
                                         r"'bn_precise', 'bn_sync', 'brn', 'gn', 'gn16', 'gn4', 'in', 'in_affine', 'ln', 'none'\]"):
        norm_layer("layernorm")(32)


@pytest.mark.parametrize("model, channels, valid", [
    (SimpleModel, [32, 64, 128, 256], [1, 2, 4, 8, 16, 32]), (ResNet20, [16, 32, 64], [1, 2, 4, 8, 16])])
def test_group_count_must_divide_every_norm_layer_of_the_model(model, channels, valid):
    found = norm_channels(model, 1, 10)
    assert sorted(set(found)) == channels
    with pytest.raises(ValueError, match=rf"^norm.groups=5 does not divide the channels {re.escape(str(channels))} "
                                         rf"of model=m; valid: {re.escape(str(valid))}$"):
        require_channels({"groups": 5}, found, "m")
    require_channels({"groups": valid[-1]}, found, "m")
    require_channels({}, found, "m")  # no groups: nothing to check


def test_check_refuses_a_group_count_of_the_chosen_model_before_anything_runs(compose):
    validated(compose("model=simple", "norm=gn", "norm.groups=32"))
    with pytest.raises(ValueError, match=r"norm.groups=32 does not divide the channels \[16, 32, 64\] of model=resnet20"):
        validated(compose("model=resnet20", "norm=gn", "norm.groups=32"))


def test_resnet20_is_he_et_als_with_a_norm_after_every_convolution():
    torch.manual_seed(0)
    model = ResNet20(norm_layer("bn"))
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert len(convs) == len(bns) == 19 and not any(c.bias is not None for c in convs)
    assert [c.out_channels for c in convs] == [16] * 7 + [32] * 6 + [64] * 6
    assert sum(isinstance(m, BasicBlock) for m in model.modules()) == 9
    conv_params = 9 * (1 * 16 + 6 * 16 * 16 + 16 * 32 + 5 * 32 * 32 + 32 * 64 + 5 * 64 * 64)
    assert sum(p.numel() for p in model.parameters()) == conv_params + 2 * (7 * 16 + 6 * 32 + 6 * 64) + 64 * 10 + 10
    sizes = []
    for block in model.blocks:
        block.register_forward_hook(lambda m, i, o: sizes.append(tuple(o.shape[1:])))
    assert model(torch.rand(2, 1, 28, 28)).shape == (2, 10)
    assert sizes == [(16, 28, 28)] * 3 + [(32, 14, 14)] * 3 + [(64, 7, 7)] * 3  # no stage at 1x1
    shortcut = model.blocks[3].downsample  # the parameter-free shortcut: every other pixel, zero channels added
    x = torch.rand(1, 16, 28, 28)
    y = shortcut(x)
    assert y.shape == (1, 32, 14, 14) and torch.equal(y[:, 8:24], x[:, :, ::2, ::2]) and not y[:, :8].any()


def test_a_cell_of_the_study_reads_mnist_and_builds_its_model_without_importing_torchvision(data_root):
    """torchvision's import takes its models, ops and torch._dynamo (about 1.5 s of every cell's process): the study's
    data and model need none of it, ResNet-20 imports it when built."""
    probe = ("import sys; from gaexp.data import data_config, open_dataset; from gaexp.model import SimpleModel, "
             "ResNet20; from gaexp.norms import norm_layer; "
             f"d = open_dataset(data_config('mnist', {str(data_root)!r})); SimpleModel(norm_layer('gn4')); "
             "print(len(d.train.labels), 'torchvision' in sys.modules); ResNet20(norm_layer('bn')); "
             "print('torchvision' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.stdout.splitlines() == ["60000 False", "True"], done.stderr[-2000:]


def test_every_norm_trains_in_resnet20_at_micro_batch_1(compose):
    for norm in NORMS:
        c = typed(compose("model=resnet20", f"norm={norm}", "regime=bs1a16"))
        model = make_model(c, 1, 10)
        F.cross_entropy(model(torch.rand(1, 1, 28, 28)), torch.tensor([3])).backward()  # BatchNorm needs 2 values
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad), norm
        assert model.eval()(torch.rand(3, 1, 28, 28)).shape == (3, 10), norm


GOOD = """
import torch
from torch import nn
def build(norm_layer, in_channels, num_classes):
    return nn.Sequential(nn.Conv2d(in_channels, 8, 3), norm_layer(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(8, num_classes))
def positional(a, b, c):
    return build(a, b, c)
def wrong_output(norm_layer, in_channels, num_classes):
    return nn.Sequential(nn.Conv2d(in_channels, 8, 3), norm_layer(8), nn.Flatten())
def fails(norm_layer, in_channels, num_classes):
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten())
"""


@pytest.fixture
def user_models(tmp_path, monkeypatch):
    (tmp_path / "user_nets.py").write_text(GOOD)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "user_nets"


def test_a_users_model_loads_by_import_path(user_models, compose):
    assert load(f"{user_models}:build") is load(f"{user_models}.build")  # both spellings
    c = validated(compose("model=custom", f"model.target={user_models}:build", "norm=gn", "norm.groups=4"))
    assert c.run_name == "custom-batched-gn-bs16a1-s1" and make_model(c, 1, 10)[1].num_groups == 4
    with pytest.raises(ValueError, match=r"norm.groups=3 does not divide the channels \[8\] of model=custom"):
        validated(compose("model=custom", f"model.target={user_models}:build", "norm=gn", "norm.groups=3"))


@pytest.mark.parametrize("target, message", [
    ("nomodule_here:build", r"^model.target='nomodule_here:build': cannot import 'nomodule_here' \(No module named"),
    ("user_nets:absent", r"^model.target='user_nets:absent': user_nets has no callable 'absent'$"),
    ("user_nets", r"^model.target='user_nets'; valid: an import path module:callable, e.g. mypkg.nets:build$"),
    ("user_nets:positional", r"^model.target='user_nets:positional': positional\(a, b, c\) must take "
                             r"norm_layer=, in_channels=, num_classes=$"),
    ("user_nets:wrong_output", r"^model.target='user_nets:wrong_output': a batch of 2 images gave output of shape "
                               r"\(2, 5408\); expected \(2, 10\) logits \(data=mnist has 10 classes\)$"),
    ("user_nets:fails", r"^model.target='user_nets:fails': its forward fails on a batch of shape \(2, 1, 28, 28\) "
                        r"\(data=mnist\): "
                        r"RuntimeError: "),
])
def test_a_bad_model_is_one_line_naming_what_was_expected(user_models, compose, target, message):
    with pytest.raises(TargetError, match=message) as info:
        validated(compose("model=custom", f"model.target={target}"))
    assert "\n" not in str(info.value)


BROKEN = """import torch
from torch import nn


def build(norm_layer, in_channels, num_classes):
    layer = norm_layer(8)
    if not isinstance(layer, nn.Identity):  # gaexp's real norm layers, not norm_channels' stand-ins
        raise RuntimeError("only with a real norm")
    return nn.Sequential(nn.Conv2d(in_channels, 8, 3), layer, nn.Flatten(), nn.LazyLinear(num_classes))


def placeholder(norm_layer, in_channels, num_classes):
    return nn.Sequential(nn.Conv2d(in_channels, 8, 3), nn.Linear(norm_layer(8).weight.shape[0], num_classes))
"""


@pytest.mark.parametrize("text, target, message", [
    ("import torch\n\ndef build(norm_layer, in_channels, num_classes)\n    pass\n", "syntax_nets:build",
     r"cannot import 'syntax_nets': SyntaxError at syntax_nets.py, line 3: expected ':'$"),
    ("import torch\nimport no_such_dependency_here\n", "needs_nets:build",
     r"cannot import 'needs_nets': ModuleNotFoundError at needs_nets.py, line 2: No module named "
     r"'no_such_dependency_here'$"),
    (BROKEN, "raising_nets:build", r"building the model raised RuntimeError at raising_nets.py, line 8: only with a "
                                   r"real norm$"),
    (BROKEN, "stand_in_nets:placeholder", r"building the model with placeholder norm layers \(nn.Identity, counting "
                                          r"their channels\) raised AttributeError at stand_in_nets.py, line 13: "
                                          r"'Identity' object has no attribute 'weight'$"),
])
def test_a_users_model_that_raises_is_one_line_naming_model_target_its_file_and_line(text, target, message, compose,
                                                                                     tmp_path, monkeypatch):
    (tmp_path / f"{target.partition(':')[0]}.py").write_text(text)  # a module name of its own: imported once
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TargetError, match=rf"^model.target='{target}': {message}") as info:
        validated(compose("model=custom", f"model.target={target}", "norm=gn4"))
    assert "\n" not in str(info.value)


def test_the_gaexp_command_ends_on_a_broken_model_file_in_one_line(tmp_path, data_root):
    """`python -m gaexp model=custom model.target=badnets:build ...` with a SyntaxError in badnets.py: no traceback,
    one line naming the key, the file and the line, before any run."""
    (tmp_path / "badnets.py").write_text("import torch\ndef build(norm_layer, in_channels, num_classes):\n"
                                         "    return torch.nn.Linear(1, 1\n")
    done = subprocess.run([sys.executable, "-m", "gaexp", "model=custom", "model.target=badnets:build", "norm=gn4",
                           "train.num_iterations=2", f"paths.outputs={tmp_path / 'out'}", f"data.root={data_root}",
                           "data.sources=[local]"], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert done.returncode != 0 and done.stdout == "" and done.stderr.splitlines() == [
        "error: model.target='badnets:build': cannot import 'badnets': SyntaxError at badnets.py, line 3: "
        "'(' was never closed"], done.stderr[-2000:]


def test_simple_model_shapes_and_size():
    model = SimpleModel(norm_layer("bn"))
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert [(c.in_channels, c.out_channels, c.kernel_size, c.padding) for c in convs] == [
        (1, 32, (3, 3), (1, 1)), (32, 64, (3, 3), (1, 1)), (64, 128, (3, 3), (1, 1)), (128, 256, (3, 3), (1, 1))]
    assert sum(isinstance(m, nn.MaxPool2d) for m in model.modules()) == 3
    conv_params = 1 * 32 * 9 + 32 + 32 * 64 * 9 + 64 + 64 * 128 * 9 + 128 + 128 * 256 * 9 + 256
    bn_params = 2 * (32 + 64 + 128 + 256)
    assert sum(p.numel() for p in model.parameters()) == conv_params + bn_params + 256 * 10 + 10
    assert model(torch.rand(2, 1, 28, 28)).shape == (2, 10)
    assert model.features[:-1](torch.rand(1, 1, 28, 28)).shape[-2:] == (3, 3)


def test_every_norm_starts_from_the_same_weights(compose):
    def convs(norm):
        options = typed(compose(f"norm={norm}", "regime=bs1a16")).norm.options()  # the schema's defaults
        torch.manual_seed(7)
        model = SimpleModel(norm_layer(norm, **options))
        return [m.weight for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]

    reference = convs("bn")
    for norm in NORMS:
        assert all(torch.equal(a, b) for a, b in zip(reference, convs(norm))), norm
