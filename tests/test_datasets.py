"""gaexp/data/dataset.py: the dataset interface. CIFAR-10 written in torchvision's own format and read by its class,
an image folder and a loader by import path each train a cell and are recorded; the shape, classes,
digest and preprocessing reach the model, the protocol, MLflow and the report; bad data is one line."""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
import socket
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient
from PIL import Image
from torchvision.datasets import CIFAR10

from gaexp import analysis
from gaexp.check import cli as check_cli
from gaexp.data import custom, limits
from gaexp.data.batches import Split
from gaexp.data.dataset import content_digest, describe, fetch, open_dataset, splits
from gaexp.analysis import AnalysisError, collect, summarize
from gaexp.callbacks import PrepareCallback, prepare
from gaexp.cell import validated, run_cell
from gaexp.data.batches import micro_batches
from gaexp.config import AnalysisConfig, RegimeConfig, TrainConfig, typed
from gaexp.data.catalog import DataError, data_config
from gaexp.model import ResNet20, SimpleModel
from gaexp.norms import norm_layer
from gaexp.train import StepPlan, train
from tests.conftest import TINY, Float64
from tests.test_imagefolder import write_folder

CIFAR_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


@pytest.fixture
def fake_cifar10(tmp_path, monkeypatch):
    """A small CIFAR-10 in torchvision's format under tmp_path/cifar/CIFAR10/cifar-10-batches-py (five pickled
    training batches of 12, a test batch of 20, batches.meta), with CIFAR10's integrity lists patched to their
    MD5s; returns (data root, train images [N, 32, 32, 3], train labels, test images, test labels)."""
    folder = tmp_path / "cifar" / "CIFAR10" / CIFAR10.base_folder
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    train_x, train_y = rng.integers(0, 256, (60, 32, 32, 3), dtype=np.uint8), rng.integers(0, 10, 60)
    test_x, test_y = rng.integers(0, 256, (20, 32, 32, 3), dtype=np.uint8), rng.integers(0, 10, 20)

    def write(name, entry):
        blob = pickle.dumps(entry)
        (folder / name).write_bytes(blob)
        return [name, hashlib.md5(blob).hexdigest()]

    def batch(x, y):  # CIFAR's rows: 1024 red, 1024 green, 1024 blue values
        return {"data": x.transpose(0, 3, 1, 2).reshape(len(x), -1), "labels": y.tolist()}

    train_list = [write(f"data_batch_{i + 1}", batch(train_x[12 * i:12 * i + 12], train_y[12 * i:12 * i + 12]))
                  for i in range(5)]
    test_list = [write("test_batch", batch(test_x, test_y))]
    meta = write("batches.meta", {"label_names": CIFAR_CLASSES})
    monkeypatch.setattr(CIFAR10, "train_list", train_list)
    monkeypatch.setattr(CIFAR10, "test_list", test_list)
    monkeypatch.setattr(CIFAR10, "meta", {"filename": "batches.meta", "key": "label_names", "md5": meta[1]})
    return tmp_path / "cifar", train_x, train_y, test_x, test_y


def prepared(cfg):
    prepare(cfg)
    return cfg


def runs_by_name(uri: str) -> dict:
    client = MlflowClient(uri)
    return {r.info.run_name: r for r in client.search_runs([client.get_experiment_by_name("gaexp").experiment_id])}


def test_cifar10_is_read_by_torchvisions_class_in_its_shape_and_classes(fake_cifar10):
    root, train_x, train_y, test_x, test_y = fake_cifar10
    d = open_dataset(data_config("cifar10", root))
    assert d.meta.shape == (3, 32, 32) and d.meta.num_classes == 10 and d.meta.classes == tuple(CIFAR_CLASSES)
    assert torch.equal(d.train.images, torch.from_numpy(train_x).permute(0, 3, 1, 2))
    assert d.train.labels.tolist() == train_y.tolist() and torch.equal(d.test.images.permute(0, 2, 3, 1),
                                                                       torch.from_numpy(test_x))
    assert d.train.augment == "crop_flip" and d.test.augment == "none" and d.train.mean == (0.4914, 0.4822, 0.4465)
    assert d.meta.digest == content_digest(d.train.images, d.train.labels, d.test.images, d.test.labels)
    assert len(d.meta.digest) == 32 and d.meta.source == (root / "CIFAR10").as_uri()


@pytest.mark.parametrize("model", ["simple", "resnet20"])
def test_a_cifar10_cell_trains_and_its_run_records_the_dataset(fake_cifar10, tmp_path, compose, model):
    root = fake_cifar10[0]
    cell = [*TINY, "data.holdout=0", f"model={model}", "norm=bn", "regime=bs4a4", "train.num_iterations=3", "data=cifar10",
            f"data.root={root}"]
    cfg = prepared(compose(*cell, outputs=tmp_path / "store"))
    accuracy = run_cell(cfg, sweep_id="s1")
    assert accuracy * 20 == round(accuracy * 20)  # evaluated on its 20 test images
    assert run_cell(cfg, sweep_id="s2") == accuracy  # skipped: the same data, the same protocol
    name = "cifar10-bn-bs4a4-s1" if model == "simple" else "cifar10-resnet20-bn-bs4a4-s1"
    (run,) = runs_by_name(cfg.mlflow.tracking_uri).values()
    assert run.info.run_name == name and run.data.tags["dataset"] == "cifar10"
    digest = open_dataset(data_config("cifar10", root)).meta.digest
    assert run.data.params["data.digest"] == digest and run.data.params["data.augment"] == "crop_flip"
    inputs = {d.dataset.name: (d.dataset, {t.key: t.value for t in d.tags}) for d in run.inputs.dataset_inputs}
    assert sorted(inputs) == ["cifar10-test", "cifar10-train"]
    profile = json.loads(inputs["cifar10-train"][0].profile)
    assert profile["content_digest"] == digest and profile["shape"] == [3, 32, 32] and profile["num_classes"] == 10
    assert profile["num_samples"] == 60 and profile["preprocessing"]["augment"] == "crop_flip"
    assert profile["preprocessing"]["mean"] == [0.4914, 0.4822, 0.4465] and profile["classes"] == CIFAR_CLASSES
    assert json.loads(inputs["cifar10-test"][0].profile)["preprocessing"]["augment"] == "none"
    assert inputs["cifar10-test"][1]["mlflow.data.context"] == "validation"
    assert json.loads(inputs["cifar10-train"][0].source)["uri"] == (root / "CIFAR10").as_uri()


def test_the_cifar10_study_file_composes_and_a_cell_of_it_runs(fake_cifar10, tmp_path, compose):
    cfg = compose("+experiment=spec_cifar10", hydra=True)
    c = typed(compose("+experiment=spec_cifar10"))
    assert (c.model.name, c.data.dataset, c.data.augment, c.train.num_iterations, c.train.eval_period) == \
        ("resnet20", "cifar10", "crop_flip", 4000, 500)
    assert dict(cfg.hydra.sweeper.params) == {"norm": "bn,in,gn4,gn16,none", "regime": "bs1a1,bs1a16,bs4a4,bs16a1",
                                              "seed": "1,2,3"}
    assert c.analysis.window_start == 2000 and c.compile == "off"
    cell = prepared(compose("+experiment=spec_cifar10", *TINY, "data.holdout=0", "norm=gn4", "regime=bs4a4", "train.num_iterations=2",
                            f"data.root={fake_cifar10[0]}", outputs=tmp_path / "store"))
    accuracy = run_cell(cell, sweep_id="study")
    assert 0 <= accuracy <= 1 and list(runs_by_name(cell.mlflow.tracking_uri)) == ["cifar10-resnet20-gn4-bs4a4-s1"]


def test_without_files_offline_a_torchvision_dataset_stops_in_one_line_naming_folder_and_files(tmp_path, monkeypatch):
    def offline(*args, **kwargs):
        raise OSError("Network is unreachable")

    monkeypatch.setattr(socket, "create_connection", offline)
    with pytest.raises(DataError) as info:
        fetch(data_config("cifar10", tmp_path))
    message = str(info.value)
    assert "\n" not in message and message.startswith(
        f"data=cifar10: no CIFAR10 files in {tmp_path}/CIFAR10 (looked for cifar-10-batches-py/data_batch_1, ")
    assert "cifar-10-batches-py/test_batch, cifar-10-batches-py/batches.meta); torchvision downloads them from " \
           "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz, unreachable here (Network is unreachable)" in message
    with pytest.raises(DataError, match=r"no SVHN files in .*/SVHN \(looked for train_32x32.mat, test_32x32.mat\); "
                                        r"put them there, or add the download: data.sources=\[local,torchvision\]"):
        fetch(data_config("svhn", tmp_path, ["local"]))
    assert not (tmp_path / "CIFAR10").exists() or not any((tmp_path / "CIFAR10").iterdir())
    with pytest.raises(DataError, match=r"data.torchvision='STL10'; valid for data.kind=torchvision: CIFAR10, "
                                        r"CIFAR100, SVHN \(the MNIST family is data.kind=idx\)"):
        fetch(data_config("cifar10", tmp_path, torchvision="STL10"))


LOADERS = '''
import torch

class Pairs(torch.utils.data.Dataset):
    """(float image in [0, 1] as ToTensor gives, label) pairs, with torchvision's `classes`."""
    classes = ["a", "b", "c", "d"]

    def __init__(self, n, size):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randint(0, 256, (n, 3, size, size), generator=g, dtype=torch.uint8)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i].float() / 255, i % 4

def tensors(n=48, size=12, classes=4):
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (n, 3, size, size), generator=g, dtype=torch.uint8)
    labels = torch.arange(n) % classes
    return (images, labels), (images[:16], labels[:16])

def dataset(n=40, size=12):
    return Pairs(n, size), None

class Fractional(Pairs):
    def __getitem__(self, i):
        return torch.full((3, 4, 4), 0.001), 0  # not k/255: a normalized image, not ToTensor's

def fractional():
    return Fractional(2, 4), None

def wrong_shape():
    return (torch.zeros(4, 5, 8, 8, dtype=torch.uint8), torch.zeros(4, dtype=torch.long)), None

def wrong_labels():
    return (torch.zeros(4, 3, 8, 8, dtype=torch.uint8), torch.tensor([0, 1, 2, 7])), None

def mismatched():
    return ((torch.zeros(4, 3, 8, 8, dtype=torch.uint8), torch.arange(4)),
            (torch.zeros(2, 3, 6, 6, dtype=torch.uint8), torch.arange(2)))

def not_splits():
    return 3

def always_ten(norm_layer, in_channels, num_classes):
    return torch.nn.Sequential(torch.nn.Conv2d(in_channels, 8, 3), norm_layer(8), torch.nn.AdaptiveAvgPool2d(1),
                               torch.nn.Flatten(), torch.nn.Linear(8, 10))
'''


@pytest.fixture
def loaders(tmp_path, monkeypatch):
    (tmp_path / "my_loaders.py").write_text(LOADERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    custom._load_custom.cache_clear()
    yield "my_loaders"
    custom._load_custom.cache_clear()
    sys.modules.pop("my_loaders", None)


def test_a_custom_loader_gives_tensors_or_a_dataset_and_bad_ones_are_one_line(loaders, tmp_path):
    d = open_dataset(data_config("custom", tmp_path, target=f"{loaders}:tensors"))
    assert d.meta.shape == (3, 12, 12) and d.meta.num_classes == 4 and len(d.train) == 48 and len(d.test) == 16
    assert d.meta.source == f"python:{loaders}:tensors"
    pairs = open_dataset(data_config("custom", tmp_path, target=f"{loaders}:dataset", holdout=8))
    assert pairs.test is None and pairs.meta.classes == ("a", "b", "c", "d") and pairs.meta.num_classes == 4
    assert torch.equal(pairs.train.images, sys.modules[loaders].Pairs(40, 12).x)  # k/255 floats back to uint8, exact
    assert describe(data_config("custom", tmp_path, target=f"{loaders}:tensors", params={"size": 20})) \
        == ((3, 20, 20), 4)

    def refused(target, match, **keys):
        with pytest.raises((DataError, ValueError), match=match) as info:
            data = data_config("custom", tmp_path, target=f"{loaders}:{target}", **keys)
            splits(open_dataset(data), data.holdout)
        assert "\n" not in str(info.value)

    refused("wrong_shape", r"its train split: images of shape \(4, 5, 8, 8\) and dtype torch.uint8; valid: uint8 "
                           r"\[N, C, H, W\] with C 1 or 3")
    refused("wrong_labels", r"data=custom: train labels in \[0, 7\]; valid: 0 .. 3 \(4 classes, data.num_classes\)",
            num_classes=4, holdout=1)
    refused("fractional", r"its train split\[0\]: float pixels must be k/255 in \[0, 1\] \(as ToTensor gives\); "
                          r"got values in \[0.001, 0.001\]", holdout=1)
    refused("mismatched", r"data=custom: test images of shape \(3, 6, 6\), train images of \(3, 8, 8\); valid: "
                          r"one shape")
    refused("not_splits", r"returned int; expected a callable taking data.params by keyword and returning \(train, "
                          r"test\)")
    refused("dataset", r"data=custom has no test split; valid: data.holdout=N, N of its 40 training images")
    refused("tensors", r"data.holdout=48; valid: an integer in \[0, 48\)", holdout=48)
    refused("tensors", r"data.digest='abc'; the data of data=custom has digest '[0-9a-f]{32}' \(the data changed",
            digest="abc")
    with pytest.raises(DataError, match=r"its 64 images of 3x12x12 take 0 MB in memory, over the limit"):
        limits.check_memory("custom", 64, (3, 12, 12), 1000)


def test_data_without_a_test_split_or_a_holdout_is_refused_before_anything_is_recorded(loaders, tmp_path, compose):
    with pytest.raises(DataError, match=r"^data=custom has no test split; valid: data.holdout=N, N of its 40 "):
        prepare(compose("data=custom", f"data.target={loaders}:dataset", outputs=tmp_path / "out"))
    assert not (tmp_path / "out" / "mlflow.db").exists()


def test_custom_data_trains_a_cell_another_loader_result_is_another_protocol(loaders, tmp_path, compose):
    cell = [*TINY, "data.holdout=0", "model=resnet20", "norm=gn4", "regime=bs4a4", "train.num_iterations=2", "data=custom",
            f"data.target={loaders}:tensors", "data.dataset=shapes"]
    cfg = prepared(compose(*cell, outputs=tmp_path / "store"))
    accuracy = run_cell(cfg, sweep_id="s1")
    assert accuracy * 16 == round(accuracy * 16)
    bigger = prepared(compose(*cell, "+data.params.n=64", outputs=tmp_path / "store"))
    run_cell(bigger, sweep_id="s2")  # not skipped: other data (its digest), the same overrides otherwise
    runs = list(MlflowClient(cfg.mlflow.tracking_uri).search_runs(
        [MlflowClient(cfg.mlflow.tracking_uri).get_experiment_by_name("gaexp").experiment_id]))
    assert len(runs) == 2 and len({r.data.tags["protocol_key"] for r in runs}) == 2
    assert {r.info.run_name for r in runs} == {"shapes-resnet20-gn4-bs4a4-s1"}
    assert len({r.data.params["data.digest"] for r in runs}) == 2


def test_a_model_not_built_for_the_class_count_is_refused_before_anything_runs(loaders, tmp_path, compose):
    with pytest.raises(ValueError, match=r"model.target='my_loaders:always_ten': a batch of 2 images gave output of "
                                         r"shape \(2, 10\); expected \(2, 4\) logits \(data=custom has 4 classes\)"):
        validated(compose("model=custom", f"model.target={loaders}:always_ten", "data=custom",
                      f"data.target={loaders}:tensors"))
    with pytest.raises(ValueError, match=r"data.num_classes=3; valid: 6 \(the classes of data=imagefolder\)"):
        folder = write_folder(tmp_path / "six", grey=False)
        for extra in ("fox", "gnu", "hen"):
            shutil.copytree(folder / "cat", folder / extra)
        validated(compose("data=imagefolder", f"data.path={folder}", "data.num_classes=3", "data.size=[8,8]"))


def test_an_image_folder_trains_a_cell_and_an_edited_image_is_another_protocol_the_report_never_pools(tmp_path,
                                                                                                     compose):
    folder = write_folder(tmp_path / "pets", per_class=6)
    cell = [*TINY, "data.holdout=0", "norm=gn4", "regime=bs4a4", "train.num_iterations=2", "data=imagefolder", f"data.path={folder}",
            "data.size=[16,16]", "data.holdout=5", "data.dataset=pets", f"data.root={tmp_path / 'store' / 'data'}"]
    cfg = prepared(compose(*cell, outputs=tmp_path / "store"))
    assert list((tmp_path / "store" / "data" / "cache").glob("folder-*.pt"))  # decoded once, before any cell
    accuracy = run_cell(cfg, sweep_id="s1")
    assert accuracy * 5 == round(accuracy * 5)  # 5 held-out images
    assert run_cell(cfg, sweep_id="s2") == accuracy  # unchanged folder: skipped
    Image.fromarray(np.zeros((16, 20, 3), dtype=np.uint8)).save(folder / "cat" / "0.png")
    run_cell(prepared(compose(*cell, outputs=tmp_path / "store")), sweep_id="s3")  # edited: trained again
    runs = runs_by_name(cfg.mlflow.tracking_uri)
    client = MlflowClient(cfg.mlflow.tracking_uri)
    all_runs = client.search_runs([client.get_experiment_by_name("gaexp").experiment_id])
    assert list(runs) == ["pets-gn4-bs4a4-s1"] and len(all_runs) == 2
    assert len({r.data.tags["protocol_key"] for r in all_runs}) == 2
    (train_input,) = [d for r in all_runs[:1] for d in r.inputs.dataset_inputs if d.dataset.name == "pets-train-minus5"]
    profile = json.loads(train_input.dataset.profile)
    assert profile["shape"] == [3, 16, 16] and profile["num_classes"] == 3 and profile["num_samples"] == 14
    assert profile["preprocessing"]["size"] == [16, 16] and profile["classes"] == ["cat", "dog", "emu"]
    with pytest.raises(AnalysisError, match=r"2 different protocols .*digest="):
        summarize(collect(client, "gaexp", sweep="all").data, AnalysisConfig(table_columns=["bs4a4"],
                                                                            reference="bs4a4"))


def test_a_bad_folder_stops_the_command_before_anything_is_recorded(tmp_path, compose):
    flat = tmp_path / "flat"
    flat.mkdir()
    Image.fromarray(np.zeros((4, 4, 3), dtype=np.uint8)).save(flat / "a.png")
    cfg = compose("data=imagefolder", f"data.path={flat}", "data.size=[8,8]", "data.holdout=1",
                  outputs=tmp_path / "out", hydra=True)
    with pytest.raises(SystemExit) as info:
        PrepareCallback().on_multirun_start(cfg)  # what the command runs first: its error is the command's last line
    assert str(info.value) == (f"error: {flat} has no class subfolders (it holds a.png); valid: one subfolder per "
                               "class, or train/ and val/ folders of them")
    assert not (tmp_path / "out").exists()  # no store, no data root, no cache


def test_a_batch_independent_norm_stays_the_true_batch_with_augmentation_on(tmp_path):
    """The study's arithmetic on colour images augmented per sample: bs4a4 against bs16a1 from the same seed,
    three Adam steps in float64, the same weights to rounding (augmentation is drawn per sample, not per
    micro-batch)."""
    images = torch.randint(0, 256, (40, 3, 16, 16), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    data = Split(images, torch.arange(40) % 10, (0.5, 0.4, 0.3), (0.25, 0.25, 0.25), "crop_flip")
    weights = {}
    for b, k in ((16, 1), (4, 4), (1, 16)):
        torch.manual_seed(1)
        model = Float64(ResNet20(norm_layer("gn4"), in_channels=3))
        train(model, data, data.take(slice(0, 8)), TrainConfig(num_iterations=3, eval_period=3), StepPlan(RegimeConfig(b, k),
              5))
        weights[b] = torch.cat([p.detach().flatten() for p in model.parameters()])
    moved = (weights[16] - weights[4]).norm() / weights[16].norm()
    assert moved < 1e-12 and (weights[16] - weights[1]).norm() / weights[16].norm() < 1e-12
    torch.manual_seed(1)
    plain = Float64(ResNet20(norm_layer("gn4"), in_channels=3))
    train(plain, Split(images, data.labels, data.mean, data.std), data.take(slice(0, 8)),
          TrainConfig(num_iterations=3, eval_period=3), StepPlan(RegimeConfig(16, 1), 5))
    assert (torch.cat([p.detach().flatten() for p in plain.parameters()]) - weights[16]).norm() > 1e-6  # it augments


def test_gaexp_check_takes_its_images_from_cifar10_or_a_folder(fake_cifar10, tmp_path, capsys):
    root = fake_cifar10[0]
    status, text = check_cli.run(["model=resnet20", "norm=bn", "--data", "cifar10", "--data-root", str(root)])
    assert status == check_cli.UNSAFE and "cifar10's first 8 training images" in text and "BatchNorm" in text
    status, text = check_cli.run(["model=resnet20", "norm=gn4", "--data", "cifar10", "--data-root", str(root)])
    assert status == check_cli.SAFE
    folder = write_folder(tmp_path / "pets", per_class=4)
    status, text = check_cli.run(["model=simple", "norm=in", "data.path=" + str(folder), "data.size=[16,16]",
                                  "--data", "imagefolder", "--data-root", str(tmp_path / "d")])
    assert status == check_cli.SAFE and "imagefolder's first 8 training images" in text
    status, text = check_cli.run(["torchvision.models:resnet18", f"data.path={folder}", "data.size=[32,32]",
                                  "--data", "imagefolder", "--data-root", str(tmp_path / "d"), "--num-classes", "3"])
    assert status == check_cli.UNSAFE and "random inputs" not in text
    status, text = check_cli.run(["torchvision.models:resnet18", "--data", "cifar10", "--data-root", str(root),
                                  "--input-shape", "3,64,64"])
    assert status == check_cli.BAD_INPUT and text == ("gaexp-check: error: --data cifar10 has images of shape 3,32,32; "
                                                      "--input-shape 3,64,64 (leave it out to use the dataset's)")


@pytest.mark.parametrize("data,key", [("imagefolder", "path"), ("custom", "target")])
def test_a_folder_or_a_loader_without_its_key_is_one_line_naming_it(compose, data, key):
    with pytest.raises(ValueError, match=rf"^data.{key} has no value; set it on the command line \(data.{key}=...\): "):
        typed(compose(f"data={data}"))
