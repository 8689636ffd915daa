"""Text data (gaexp/data/text.py): a folder of text files in fortune's format and one document per file, the
Debian package's layout (a .deb written here, kept where a download leaves it: no apt-get), padding and packing,
and the language-model task through the public command: a sweep of two normalizations recorded and reported in
nats, its rows the loss's normalizations."""

from __future__ import annotations

import dataclasses
import io
import subprocess
import sys
import tarfile

import pytest
import torch
from mlflow.tracking import MlflowClient

from gaexp.data.catalog import DataError, data_config
from gaexp.data.dataset import describe, open_dataset
from gaexp.data.text import EOD, PAD, TextSplit, documents, sequences
from tests.test_data import ar_archive, tar_xz

COOKIES = {"wisdom": b"A penny saved\nis a penny earned.\n%\nLook before\r\nyou leap.\n%\n%\nHaste makes waste.\n",
           "zippy": b"Are we having FUN yet?\n%\nYow!\x00\n"}


def write_cookies(folder, files=COOKIES):
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_bytes(text)
        (folder / f"{name}.dat").write_bytes(b"\x00\x00\x00\x02binary strfile index")  # fortune's index: skipped
    (folder / ".hidden").write_bytes(b"not a document")
    return folder


def test_a_folder_in_fortunes_format_gives_its_documents_in_order(tmp_path):
    folder = write_cookies(tmp_path / "cookies")
    assert documents(folder, "%") == [b"A penny saved\nis a penny earned.", b"Look before\nyou leap.",
                                      b"Haste makes waste.", b"Are we having FUN yet?", b"Yow!"]
    assert documents(folder, None) == [COOKIES["wisdom"].replace(b"\r\n", b"\n").strip(b"\n"),
                                       COOKIES["zippy"].replace(b"\x00", b"").strip(b"\n")]


def test_padded_sequences_vary_in_length_and_packed_blocks_do_not():
    docs = [b"ab", b"abcdefghij", b"x"]
    tokens, lengths = sequences(docs, 4, packed=False)
    assert lengths.tolist() == [3, 5, 2]  # each document and its EOD, cut to context + 1
    assert tokens[0, 0, 0].tolist() == [97, 98, EOD, PAD, PAD]
    inputs, targets = TextSplit(tokens, lengths).window(slice(None))
    assert inputs.shape == targets.shape == (3, 4) and (targets != -100).sum(1).tolist() == [2, 4, 1]
    packed, lengths = sequences(docs, 4, packed=True)
    stream = b"ab\x01abcdefghij\x01x\x01"
    assert lengths.tolist() == [5, 5, 5] and bytes(packed.flatten().tolist()) == stream[:15]


def build_fortunes_deb(path, folder, files):
    """A .deb in fortunes' layout: plain files and their .dat indexes in `folder`, a .u8 symlink, a doc file."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:xz") as tar:
        for name, content in {**{f"./{folder}/{n}": t for n, t in files.items()},
                              **{f"./{folder}/{n}.dat": b"\x00\x02" for n in files},
                              "./usr/share/doc/fortunes/copyright": b"BSD"}.items():
            info = tarfile.TarInfo(name)
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
        link = tarfile.TarInfo(f"./{folder}/wisdom.u8")
        link.type, link.linkname = tarfile.SYMTYPE, "wisdom"
        tar.addfile(link)
    path.write_bytes(ar_archive({"debian-binary": b"2.0\n", "control.tar.xz": tar_xz({"./control": b"Package: f\n"}),
                                 "data.tar.xz": buffer.getvalue()}))
    return path


def test_the_debian_package_is_unpacked_once_and_read_as_its_documents(tmp_path):
    spec = dataclasses.replace(data_config("fortunes", tmp_path), digest=None, holdout=1, context=16)
    build_fortunes_deb(tmp_path / f"fortunes_{spec.debian.version.replace(':', '%3a')}_all.deb", spec.debian.folder,
                       COOKIES)
    data = open_dataset(spec)
    assert isinstance(data.train, TextSplit) and len(data.train) == 5 and data.test is None
    assert sorted(p.name for p in (tmp_path / "fortunes").iterdir()) == [
        ".complete", "wisdom", "wisdom.dat", "zippy", "zippy.dat"]  # no symlink, no doc, nothing installed
    assert describe(spec) == ((1, 1, 17), 256) and data.meta.num_classes == 256
    (tmp_path / f"fortunes_{spec.debian.version.replace(':', '%3a')}_all.deb").unlink()  # unpacked: not needed again
    again = open_dataset(spec)
    assert torch.equal(again.train.images, data.train.images) and again.meta.digest == data.meta.digest
    with pytest.raises(DataError, match=r"^data.digest='0+'; the data of data=fortunes has digest '[0-9a-f]{32}'"):
        open_dataset(dataclasses.replace(spec, digest="0" * 32))


def test_the_pinned_digest_is_the_real_packages(tmp_path):
    """The digest in conf/data/fortunes.yaml is that of the documents of fortunes 1:1.99.1-7.3 (docs/data.md):
    checked against the package where this machine has it (CI's apt-get download), else its pin's form only."""
    spec = data_config("fortunes", tmp_path)
    assert len(spec.digest) == 32 and spec.context == 128 and spec.separator == "%"
    got = subprocess.run(["apt-get", "download", f"fortunes={spec.debian.version}"], cwd=tmp_path,
                         capture_output=True, timeout=300) if sys.platform == "linux" else None
    if got is None or got.returncode != 0:
        pytest.skip("the fortunes package is not reachable here: its pin is checked where apt-get download works")
    assert open_dataset(spec).meta.digest == spec.digest


def test_a_language_model_sweep_through_the_public_command_is_reported_in_nats(tmp_path, gaexp_command):
    texts = write_cookies(tmp_path / "texts", {f"doc{i}.txt": bytes(range(97, 97 + 3 + 7 * i)) for i in range(12)})
    proc = gaexp_command(tmp_path, "task=lm", "model=gpt", "norm=ln", "data=textfolder", f"data.path={texts}",
                         "data.holdout=4", "data.context=16", "regime=bs4a1,bs2a2", "task.loss=token_mean,step_token_mean",
                         "accumulate=auto", "analysis.rows=task.loss", "analysis.table_columns=[bs4a1,bs2a2]",
                         "analysis.reference=bs4a1", "analysis.ranked_regime=bs2a2", "analysis.baselines=[]",
                         "analysis.margin=0.05")
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = {r.info.run_name: r for r in client.search_runs(client.get_experiment_by_name("gaexp").experiment_id)
            if "norm" in r.data.tags}
    assert sorted(runs) == ["textfolder-gpt-step_token_mean-batched-ln-bs2a2-s1",
                            "textfolder-gpt-step_token_mean-batched-ln-bs4a1-s1", "textfolder-gpt-token_mean-batched-ln-bs2a2-s1",
                            "textfolder-gpt-token_mean-batched-ln-bs4a1-s1"]
    run = runs["textfolder-gpt-token_mean-batched-ln-bs2a2-s1"]
    assert {"valid_loss", "valid_ppl", "final_valid_loss", "best_valid_loss"} <= set(run.data.metrics)
    assert "valid_acc" not in run.data.metrics and run.data.params["task.loss"] == "token_mean"
    assert run.data.metrics["best_valid_loss"] <= run.data.metrics["final_valid_loss"]
    from gaexp.cell import finished_value  # what the same command returns for this cell, FINISHED, when it resumes
    from gaexp.config import compose_config, typed
    c = typed(compose_config(["task=lm", "model=gpt", "norm=ln", "data=textfolder", f"data.path={texts}"], hydra=False))
    assert finished_value(c, client, run) == run.data.metrics["final_valid_loss"]
    table = next((tmp_path / "reports").glob("*/table.md")).read_text()
    assert table.startswith("textfolder, gpt: mean validation loss per token (nats) over evaluations at step > 0")
    assert "| loss | bs4a1 | bs2a2 |" in table and "| token_mean | " in table and "| step_token_mean | " in table
    assert "Paired (same seed) difference to bs4a1, nats, 95% t-interval; verdict at a margin of ±0.05 nats" in table
    speed = run.data.metrics["tokens_per_sec"] / run.data.metrics["samples_per_sec"]  # tokens per sequence trained
    assert 2 <= speed <= 16, speed
    memory = (next((tmp_path / "reports").glob("*/memory.csv"))).read_text().splitlines()
    assert "samples_per_sec,tokens_per_sec,wall_seconds" in memory[0] and len(memory) == 3, memory


def test_a_language_models_speed_counts_the_predicted_tokens_it_trained_on():
    """tokens_per_sec: the predicted tokens of every sequence the steps drew (each one's length less its first
    token), over the same seconds as samples_per_sec; an image counts as one."""
    from gaexp.config import RegimeConfig, TrainConfig
    from gaexp.data.batches import counted, micro_batches
    from gaexp.gpt import gpt
    from gaexp.norms import norm_layer
    from gaexp.task.lm import IGNORE, LanguageModel
    from gaexp.train import StepPlan, train
    docs = [bytes(range(97, 97 + 3 + 5 * i)) for i in range(12)]
    data = TextSplit(*sequences(docs, 16, packed=False))
    tally, drawn = [0], []
    for draw in counted(micro_batches(len(data), 3, 0), data, tally):
        drawn.append(int((data.batch(draw)[1] != IGNORE).sum()))
        if len(drawn) == 8:
            break
    assert int(tally[0]) == sum(drawn) and 8 * 3 < sum(drawn) < 8 * 3 * 16
    torch.manual_seed(0)
    net = gpt(norm_layer("ln"), 1, 256, context=16, layers=1, width=16, heads=2)
    history = train(net, data, data, TrainConfig(num_iterations=4, eval_period=4, lr=1e-3),
                    StepPlan(RegimeConfig(batch_size=3, num_accum=2), seed=0), LanguageModel("token_mean"))
    point = history[-1]
    assert point.speed["tokens_per_sec"] / point.samples_per_sec == pytest.approx(sum(drawn) / 24, rel=1e-9)
    images = TextSplit(torch.zeros(5, 1, 1, 4, dtype=torch.uint8), torch.full((5,), 4))
    assert int(super(TextSplit, images).items(torch.arange(3))) == 3
