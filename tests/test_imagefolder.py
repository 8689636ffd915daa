"""gaexp/data/folder.py: a folder of images in ImageFolder's layout, decoded, resized, converted, cached by the
folder's content digest; bad folders refused in one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.datasets import ImageFolder

from gaexp.data import folder as imagefolder
from gaexp.data.catalog import DataError

CLASSES = ("cat", "dog", "emu")


def write_folder(root: Path, per_class: int = 3, sizes=((20, 16), (24, 24), (18, 30)), grey: bool = True,
                 seed: int = 0) -> Path:
    """RGB PNGs of mixed sizes (width, height), per_class of each class, and (grey) one greyscale image."""
    rng = np.random.default_rng(seed)
    for c, name in enumerate(CLASSES):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            w, h = sizes[(c + i) % len(sizes)]
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / name / f"{i}.png")
    if grey:
        Image.fromarray(rng.integers(0, 256, (16, 16), dtype=np.uint8), mode="L").save(root / "dog" / "grey.png")
    return root


def test_a_folder_decodes_as_imagefolder_with_the_resize_and_channels_asked(tmp_path):
    folder = write_folder(tmp_path / "pets")
    loaded = imagefolder.load(folder, 3, [8, 12], tmp_path / "cache")
    images, labels = loaded.train
    reference = ImageFolder(str(folder))  # torchvision's own reading of the layout: classes, order, labels
    assert loaded.classes == tuple(reference.classes) == CLASSES and loaded.test is None
    assert labels.tolist() == [label for _, label in reference.samples]
    assert images.shape == (10, 3, 8, 12) and images.dtype == torch.uint8
    for image, (path, _) in zip(images, reference.samples):
        expected = np.asarray(Image.open(path).convert("RGB").resize((12, 8), Image.BILINEAR)).transpose(2, 0, 1)
        assert torch.equal(image, torch.from_numpy(expected.copy()))
    grey = images[[p.endswith("grey.png") for p, _ in reference.samples].index(True)]
    assert torch.equal(grey[0], grey[1]) and torch.equal(grey[1], grey[2])  # grey converted to RGB: equal channels
    assert imagefolder.describe(folder, 3, [8, 12]) == ((3, 8, 12), 3)
    one = imagefolder.load(folder, 1, [8, 12], tmp_path / "cache").train[0]
    assert one.shape == (10, 1, 8, 12)


def test_the_cache_serves_an_unchanged_folder_and_never_an_edited_one(tmp_path, monkeypatch):
    folder = write_folder(tmp_path / "pets")
    first = imagefolder.load(folder, 3, [8, 8], tmp_path / "cache")
    assert len(list((tmp_path / "cache").glob("folder-*.pt"))) == 1

    def no_decoding(*args, **kwargs):
        raise AssertionError("decoded again")

    monkeypatch.setattr(imagefolder, "_decode", no_decoding)
    again = imagefolder.load(folder, 3, [8, 8], tmp_path / "cache")
    assert again.digest == first.digest and torch.equal(again.train[0], first.train[0])
    monkeypatch.undo()

    Image.fromarray(np.zeros((16, 20, 3), dtype=np.uint8)).save(folder / "cat" / "0.png")  # one image edited
    edited = imagefolder.load(folder, 3, [8, 8], tmp_path / "cache")
    assert edited.digest != first.digest and not torch.equal(edited.train[0], first.train[0])
    assert (edited.train[0][0] == 0).all() and torch.equal(edited.train[0][1:], first.train[0][1:])
    assert len(list((tmp_path / "cache").glob("folder-*.pt"))) == 2
    (folder / "emu" / "2.png").rename(folder / "emu" / "3.png")  # renamed, still last: the same bytes in the same
    assert imagefolder.folder_digest(folder) != edited.digest    # order, another folder


def test_train_and_val_folders_are_the_two_splits(tmp_path):
    write_folder(tmp_path / "pets" / "train", grey=False)
    write_folder(tmp_path / "pets" / "val", per_class=1, grey=False, seed=1)
    loaded = imagefolder.load(tmp_path / "pets", 3, [8, 8], tmp_path / "cache")
    assert loaded.train[0].shape == (9, 3, 8, 8) and loaded.test[0].shape == (3, 3, 8, 8)
    assert loaded.test[1].tolist() == [0, 1, 2]


def test_bad_folders_are_refused_in_one_line(tmp_path):
    def refused(folder: Path, match: str, size=(8, 8)) -> None:
        with pytest.raises(DataError, match=match) as info:
            imagefolder.load(folder, 3, size, tmp_path / "cache")
        assert "\n" not in str(info.value)
        assert not (tmp_path / "cache").exists()  # nothing written

    flat = tmp_path / "flat"
    flat.mkdir()
    Image.fromarray(np.zeros((4, 4, 3), dtype=np.uint8)).save(flat / "a.png")
    refused(flat, r"flat has no class subfolders \(it holds a.png\); valid: one subfolder per class")
    refused(tmp_path / "absent", r"data.path='.*absent' is not a folder; valid: a folder of class subfolders")
    empty = write_folder(tmp_path / "empty", grey=False)
    (empty / "fox").mkdir()
    refused(empty, r"class folder .*empty/fox is empty; valid: at least one image per class")
    text = write_folder(tmp_path / "text", grey=False)
    (text / "cat" / "notes.txt").write_text("not an image")
    (text / "cat" / ".DS_Store").write_bytes(b"\0\1")  # hidden: skipped, as ImageFolder's users expect
    refused(text, r"text/cat/notes.txt is not an image \(UnidentifiedImageError: .*\); valid: image files only")
    mixed = write_folder(tmp_path / "mixed", grey=False)
    refused(mixed, r"images of different sizes: .*cat/0.png is 20x16, .*cat/1.png is 24x24 \(width x height\); "
                   r"valid: one size, or set data.size=\[height,width\]", size=None)
    with pytest.raises(DataError, match=r"data.channels=None; valid for an image folder: 1 \(grey\) or 3 \(RGB\)"):
        imagefolder.load(mixed, None, (8, 8), tmp_path / "cache")
    write_folder(tmp_path / "split" / "train", grey=False)
    (tmp_path / "split" / "val" / "cat").mkdir(parents=True)
    Image.fromarray(np.zeros((4, 4, 3), dtype=np.uint8)).save(tmp_path / "split" / "val" / "cat" / "a.png")
    refused(tmp_path / "split", r"val has classes \['cat'\], .*train has \['cat', 'dog', 'emu'\]; valid: the same")


def test_a_folder_over_the_memory_limit_is_refused_before_decoding(tmp_path, monkeypatch):
    folder = write_folder(tmp_path / "pets")
    monkeypatch.setattr(imagefolder, "_decode", lambda *a, **k: pytest.fail("decoded"))
    with pytest.raises(DataError, match=r"data=pets: its 10 images of 3x512x512 take 8 MB in memory, over the "
                                         r"limit of 1 MB \(data.max_memory_mb"):
        imagefolder.load(folder, 3, [512, 512], tmp_path / "cache", limit=2**20, name="pets")
