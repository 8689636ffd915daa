"""Text as gaexp's data (`data.kind=text`): a corpus of documents of varied length, read as bytes (a vocabulary of
256 with no tokenizer to download), one sequence per document (padded) or packed into fixed-length blocks.

A corpus is a folder of text files (`data.path`, read recursively in name order): each file is one document, or,
with `data.separator`, several, separated by lines holding only the separator (`%`, the strfile format of
fortune's files). `data=fortunes` is the Debian package `fortunes` (fortune-mod's cookies), fetched with
`apt-get download` the first time and unpacked under the data root; its content digest is pinned in its file.

Tokens are the UTF-8 bytes, with bytes 0 and 1 removed from the text: 0 pads, 1 ends a document (`EOD`).
- `data.packed=false`: each document plus EOD is one sequence, cut to `data.context + 1` tokens and padded with
  0, so the sequences of a batch predict different numbers of tokens (what makes a micro-batch's token mean
  differ from the step's);
- `data.packed=true`: the documents, each followed by EOD, concatenated and cut into blocks of `context + 1`:
  every sequence predicts `context` tokens.

A split is a `TextSplit`: its `images` hold the tokens, uint8 [N, 1, 1, context + 1], and its `labels` each
sequence's token count, so that the data wing's holding-out, device moves and memory checks apply as they are.
"""

from __future__ import annotations

import hashlib
import io
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from gaexp.config import DataConfig
from gaexp.data.batches import Draw, Split
from gaexp.data.catalog import Arrays, DataError

PAD, EOD = 0, 1
VOCAB = 256


@dataclass(frozen=True)
class TextSplit(Split):
    """Sequences of byte tokens: `images` uint8 [N, 1, 1, context + 1] (PAD after a sequence's end), `labels`
    int64 [N] each sequence's length in tokens."""

    def window(self, index: torch.Tensor | slice) -> tuple[torch.Tensor, torch.Tensor]:
        """(input tokens, next tokens) of the sequences at `index`, int64 [B, context] each; a target is
        IGNORE (gaexp/task/lm.py) where the sequence has ended."""
        tokens = self.images[index][:, 0, 0].long()
        targets = tokens[:, 1:].clone()
        targets[targets == PAD] = -100
        return tokens[:, :-1], targets

    def inputs(self, index: torch.Tensor | slice, draw: Draw | None = None) -> torch.Tensor:
        return self.window(index)[0]

    def batch(self, draw: Draw) -> tuple[torch.Tensor, torch.Tensor]:
        return self.window(draw.index)

    def items(self, index: torch.Tensor) -> torch.Tensor:
        """The sequences' predicted tokens (all but each one's first): the targets `window` does not IGNORE."""
        return (self.labels[index] - 1).sum()


def documents(folder: Path, separator: str | None) -> list[bytes]:
    """The corpus's documents in order: its files by name (recursively; hidden files and fortune's `.dat` indexes
    skipped), each split at lines holding only `separator`; empty documents dropped."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not p.is_symlink()
                   and not any(part.startswith(".") for part in p.relative_to(folder).parts) and p.suffix != ".dat")
    if not files:
        raise DataError(f"{folder}: no text files; valid: data.path=a folder of text files (docs/data.md)")
    docs = []
    for path in files:
        text = path.read_bytes().replace(b"\r\n", b"\n").translate(None, bytes([PAD, EOD]))
        parts = [text] if separator is None else _split(text, separator.encode())
        docs += [d.strip(b"\n") for d in parts if d.strip()]
    return docs


def _split(text: bytes, separator: bytes) -> list[bytes]:
    lines, docs, current = text.split(b"\n"), [], []
    for line in lines:
        if line.strip() == separator:
            docs.append(b"\n".join(current))
            current = []
        else:
            current.append(line)
    return docs + [b"\n".join(current)]


def sequences(docs: list[bytes], context: int, packed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens uint8 [N, 1, 1, context + 1], lengths int64 [N]) of the documents (see the module's docstring);
    sequences of fewer than 2 tokens (nothing to predict) are dropped."""
    width = context + 1
    if packed:
        stream = b"".join(d + bytes([EOD]) for d in docs)
        n = len(stream) // width
        tokens = torch.frombuffer(bytearray(stream[:n * width]), dtype=torch.uint8).view(n, 1, 1, width)
        return tokens, torch.full((n,), width, dtype=torch.long)
    cut = [(d + bytes([EOD]))[:width] for d in docs]
    cut = [c for c in cut if len(c) >= 2]
    tokens = torch.zeros(len(cut), 1, 1, width, dtype=torch.uint8)
    for i, c in enumerate(cut):
        tokens[i, 0, 0, :len(c)] = torch.frombuffer(bytearray(c), dtype=torch.uint8)
    return tokens, torch.tensor([len(c) for c in cut], dtype=torch.long)


def corpus_folder(data: DataConfig) -> Path:
    """Where the corpus is: `data.path`, or the Debian package's files unpacked under the data root (fetched the
    first time, the package kept beside them)."""
    if data.path is not None:
        folder = Path(data.path).expanduser()
        if not folder.is_dir():
            raise DataError(f"data.path={data.path!r} is not a folder; valid: a folder of text files (docs/data.md)")
        return folder
    if data.debian is None:
        raise DataError(f"data={data.dataset}: data.kind=text needs data.path=a folder of text files")
    from gaexp.data.idx import _from_debian_deb  # the package fetch the MNIST family's Debian source uses
    root = Path(data.root).expanduser().resolve()
    folder = root / data.dataset
    if not (folder / ".complete").is_file():
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=root, prefix=f".{data.dataset}-debian-") as tmp:
            deb = _from_debian_deb(Path(tmp), root, data.debian)
            unpack_folder(deb, data.debian.folder, Path(tmp) / "corpus")
            (Path(tmp) / "corpus" / ".complete").write_text(data.debian.version + "\n")
            if folder.exists():
                raise DataError(f"{folder} exists but is incomplete (no .complete): remove it and run again")
            (Path(tmp) / "corpus").replace(folder)
    return folder


def unpack_folder(deb: Path, folder: str, out: Path) -> None:
    """The regular files under `folder` in the .deb's data.tar, written to `out` (nothing installed)."""
    from gaexp.data.idx import ar_members
    members = ar_members(deb)
    data_tar = next((n for n in members if n.startswith("data.tar")), None)
    if data_tar is None:
        raise DataError(f"{deb} has no data.tar member (members: {sorted(members)})")
    out.mkdir(parents=True)
    prefix = folder.strip("/") + "/"
    with tarfile.open(fileobj=io.BytesIO(members[data_tar]), mode="r:*") as tar:
        for member in tar.getmembers():
            name = member.name.removeprefix("./")
            if member.isfile() and name.startswith(prefix) and "/" not in name[len(prefix):]:
                (out / name[len(prefix):]).write_bytes(tar.extractfile(member).read())


def read(data: DataConfig) -> Arrays:
    """The corpus as one training split of sequences (no test split: data.holdout sequences evaluate)."""
    folder = corpus_folder(data)
    docs = documents(folder, data.separator)
    tokens, lengths = sequences(docs, data.context, data.packed)
    if len(tokens) < 2:
        raise DataError(f"data={data.dataset}: {len(tokens)} sequences in {folder}; valid: a corpus of at least 2")
    digest = hashlib.sha256(b"\0".join(docs)).hexdigest()[:32]  # the corpus's, whatever data.context and packed
    return Arrays(tokens, lengths, None, None, (), folder.as_uri(), digest)
