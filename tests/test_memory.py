from __future__ import annotations

import mmap

import pytest
import torch
from torch import nn


from gaexp.memory import activation_bytes, peak_rss_bytes, reset_peak_rss
from gaexp.model import SimpleModel
from gaexp.norms import norm_layer


def test_activation_bytes_of_a_linear_layer_by_hand():
    """Linear saves its input; cross-entropy saves log-probabilities, the target and a scalar weight."""
    x, y = torch.rand(5, 4), torch.zeros(5, dtype=torch.long)
    expected = 5 * 4 * 4 + 5 * 3 * 4 + 5 * 8 + 4  # input, log_softmax output (float32), target (int64), total_weight
    assert activation_bytes(nn.Linear(4, 3), x, y) == expected


def test_activation_memory_scales_with_the_micro_batch(train_split):
    model = SimpleModel(norm_layer("bn")).to(memory_format=torch.channels_last)
    buffers = {k: v.clone() for k, v in model.state_dict().items()}
    sizes = {b: activation_bytes(model, train_split.inputs(slice(0, b)), train_split.labels[:b]) for b in (1, 4, 16)}
    assert 450_000 < sizes[1] < 600_000  # about 0.5 MB of activations per image
    assert abs(sizes[16] / sizes[1] - 16) < 0.5 and abs(sizes[4] / sizes[1] - 4) < 0.2
    assert all(torch.equal(v, buffers[k]) for k, v in model.state_dict().items())  # measured on a copy


def test_peak_rss_is_reset_and_read():
    """A 64 MiB block raises the peak; once it is freed, a reset brings the peak back down to what the process
    holds now (a reused worker measures its next cell, not the largest one before it)."""
    if not reset_peak_rss():
        pytest.skip("no /proc/self/clear_refs here: the peak cannot be reset (peaks are since process start)")
    before = peak_rss_bytes()
    # A fresh anonymous mapping, every page written: new resident memory whatever the heap holds (64 MiB from
    # malloc can come from freed, still resident heap memory after earlier tests in the same process).
    block = mmap.mmap(-1, 64 * 2**20)
    block.write(b"\1" * len(block))
    high = peak_rss_bytes()
    assert high >= before + 60 * 2**20
    block.close()  # unmapped at once
    assert peak_rss_bytes() >= high - 8 * 2**20  # freeing alone does not lower a peak (the kernel counts RSS lazily)
    assert reset_peak_rss()
    assert peak_rss_bytes() <= high - 50 * 2**20
