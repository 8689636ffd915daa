from __future__ import annotations

import pytest
import torch
from torch import nn

from gaexp.config import typed
from gaexp.model import SimpleModel
from gaexp.norms import layer, NORMS, norm2d


def test_registry_keeps_the_study_defaults():
    bn = norm2d("bn", 32)
    assert isinstance(bn, nn.BatchNorm2d) and bn.affine and bn.momentum == 0.1 and bn.track_running_stats
    inorm = norm2d("in", 32)
    assert isinstance(inorm, nn.InstanceNorm2d) and not inorm.affine and not inorm.track_running_stats
    assert norm2d("gn4", 64).num_groups == 4 and norm2d("gn16", 64).num_groups == 16
    assert norm2d("gn4", 64).affine
    assert isinstance(norm2d("none", 8), nn.Identity)
    assert norm2d("gn", 64, groups=8).num_groups == 8


def test_unknown_norm_lists_valid_names():
    with pytest.raises(ValueError, match=r"norm.name='layernorm'; valid: \['bn', 'bn_kmom', 'bn_microeval', "
                                         r"'bn_precise', 'brn', 'gn', 'gn16', 'gn4', 'in', 'in_affine', 'ln', 'none'\]"):
        norm2d("layernorm", 32)


def test_group_count_must_divide_every_layer():
    with pytest.raises(ValueError, match=r"norm.groups=5 does not divide the channels \[32, 64, 128, 256\]; "
                                         r"valid: \[1, 2, 4, 8, 16, 32\]"):
        SimpleModel(layer("gn", groups=5))
    assert SimpleModel(layer("gn", groups=32)).features[1].num_groups == 32


def test_simple_model_shapes_and_size():
    model = SimpleModel(layer("bn"))
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
        model = SimpleModel(layer(norm, **options))
        return [m.weight for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]

    reference = convs("bn")
    for norm in NORMS:
        assert all(torch.equal(a, b) for a, b in zip(reference, convs(norm))), norm
