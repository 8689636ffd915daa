"""The typed schema: what composes, what it refuses and how, and what its runtime mark derives."""

from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path

import pytest
import torch
from torch import nn
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from gaexp import tracking
from gaexp.config import (CONFIG_DIR, OBJECTIVE_KEYS, PROTOCOL_COLUMNS, AnalysisConfig, Config, RegimeConfig, protocol_part, regime_name,
                          composition_problem, hydra_overrides, runtime_keys, typed, unknown_choice)
from gaexp.configdocs import DOCS_PAGE, markdown_table
from gaexp.machine import cgroup_cpus, cpu_kind, usable_cores
from gaexp.model import SimpleModel
from gaexp.layers import BatchRenorm2d, CrossReplicaBatchNorm2d, MicroBatchEvalBatchNorm2d, PreciseBatchNorm2d
from gaexp.norms import NORMS, norm_layer
from gaexp.train import StepPlan, train

NORM_CHOICES = ["bn", "in", "gn4", "gn16", "none", "gn", "ln", "in_affine", "bn_precise", "bn_microeval", "brn", "bn_kmom",
                "bn_sync"]
REGIMES = {"bs1a1": (1, 1), "bs1a16": (1, 16), "bs4a4": (4, 4), "bs16a1": (16, 1)}
REPO = Path(__file__).resolve().parent.parent


def test_defaults_are_the_study_protocol(compose, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    c = typed(compose())
    assert isinstance(c, Config) and isinstance(c.regime, RegimeConfig)
    assert (c.norm.name, c.regime.batch_size, c.regime.num_accum, c.seed) == ("bn", 16, 1, 1)
    assert (c.train.num_iterations, c.train.eval_period, c.train.lr, c.train.loss_window) == (3600, 300, 1e-3, 100)
    assert (c.device, c.threads, c.compile, c.cells_at_once) == ("auto", "auto", "auto", None)
    # every path is absolute and under outputs/ of the launch folder
    assert c.data.root == str(tmp_path / "outputs" / "data")
    assert c.mlflow.tracking_uri == f"sqlite:///{tmp_path}/outputs/mlflow.db"
    assert c.mlflow.artifact_location == str(tmp_path / "outputs" / "mlartifacts")
    assert c.analysis == AnalysisConfig() and c.analysis.baseline_cells() == [("bn", "bs16a1"), ("in", "bs1a16")]


def test_config_groups_match_the_registry():
    assert sorted(NORM_CHOICES) == sorted(NORMS) == sorted(p.stem for p in (REPO / "conf" / "norm").glob("*.yaml")
                                                           if p.stem != "custom")  # a norm of one's own: norm.target


# What each norm's four layers must be, with the options that tell them apart (regime bs4a4 where one matters).
NORM_LAYERS = {
    "bn": (nn.BatchNorm2d, dict(momentum=0.1, affine=True, track_running_stats=True)),
    "in": (nn.InstanceNorm2d, dict(affine=False, track_running_stats=False)),
    "gn4": (nn.GroupNorm, dict(num_groups=4, affine=True)),
    "gn16": (nn.GroupNorm, dict(num_groups=16, affine=True)),
    "gn": (nn.GroupNorm, dict(num_groups=8)),
    "none": (None, {}),
    "ln": (nn.GroupNorm, dict(num_groups=1)),
    "in_affine": (nn.InstanceNorm2d, dict(affine=True, track_running_stats=False)),
    "bn_precise": (PreciseBatchNorm2d, dict(stats_batch_size=16, stats_samples=4096)),
    "bn_microeval": (MicroBatchEvalBatchNorm2d, dict(micro_batch=4)),
    "brn": (BatchRenorm2d, dict(num_accum=4, r_max=3.0, d_max=5.0)),
    "bn_kmom": (nn.BatchNorm2d, dict(momentum=1 - 0.9 ** (1 / 4))),
    "bn_sync": (CrossReplicaBatchNorm2d, dict(momentum=0.1, affine=True, track_running_stats=True)),
}
NORM_TYPES = tuple({t for t, _ in NORM_LAYERS.values() if t is not None})


@pytest.mark.parametrize("norm,regime", list(itertools.product(NORM_CHOICES, REGIMES)))
def test_every_cell_composes_and_trains(norm, regime, compose, train_split, small_valid):
    c = typed(compose(f"norm={norm}", f"regime={regime}", "seed=2", "train.num_iterations=2", "train.eval_period=1"))
    assert (c.regime.batch_size, c.regime.num_accum) == REGIMES[regime] and c.regime.name == regime
    torch.manual_seed(c.seed)
    model = SimpleModel(norm_layer(c.norm.name, **c.norm.options())).to(memory_format=torch.channels_last)
    layers = [m for m in model.modules() if isinstance(m, NORM_TYPES)]
    kind, options = NORM_LAYERS[norm]
    if kind is None:
        assert layers == [] and sum(isinstance(m, nn.Identity) for m in model.modules()) == 4
    else:
        assert [type(m) for m in layers] == [kind] * 4 and [m.num_features if hasattr(m, "num_features") else
                                                            m.num_channels for m in layers] == [32, 64, 128, 256]
        if norm not in ("bn_precise", "bn_microeval", "brn", "bn_kmom") or regime == "bs4a4":
            assert all(getattr(m, k) == pytest.approx(v) for m in layers for k, v in options.items()), norm
    before = [p.detach().clone() for p in model.parameters()]
    history = train(model, train_split, small_valid, c.train, StepPlan(c.regime, c.seed))
    assert [p.step for p in history] == [1, 2]
    assert all(0.0 <= p.value <= 1.0 and p.train_loss > 0 for p in history)
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))  # every tensor trained
    tracked = [int(m.num_batches_tracked) for m in layers if getattr(m, "track_running_stats", False)]
    assert tracked == ([2 * c.regime.num_accum] * 4 if kind in (nn.BatchNorm2d, PreciseBatchNorm2d,
                                                               MicroBatchEvalBatchNorm2d, BatchRenorm2d,
                                                               CrossReplicaBatchNorm2d) else [])


def test_norm_options_follow_the_regime(compose):
    c = typed(compose("norm=bn_precise", "regime=bs4a4"))
    assert c.norm.options() == {"stats_batch_size": 16, "stats_samples": 4096}
    assert typed(compose("norm=brn", "regime=bs1a16")).norm.options() == {
        "num_accum": 16, "r_max": 3.0, "d_max": 5.0, "warmup_steps": 300, "ramp_steps": 1200}
    assert typed(compose("norm=bn_microeval", "regime=bs4a4")).norm.micro_batch == 4
    assert typed(compose("norm=bn")).norm.options() == {}


def test_plain_overrides_of_batch_and_accumulation(compose):
    c = typed(compose("regime.batch_size=2", "regime.num_accum=8"))
    assert c.regime.name == regime_name(2, 8) == "bs2a8" and c.run_name == "bn-bs2a8-s1"


@pytest.mark.parametrize("name,bkw", [("bs3a5", (3, 5, 1)), ("w2b8a1", (8, 1, 2)), ("w4b1a4", (1, 4, 4)),
                                      ("bs4a4", (4, 4, 1)), ("w12b10a3", (10, 3, 12))])
def test_any_regime_composes_by_its_name(compose, name, bkw):
    c = typed(compose(f"regime={name}"))  # as MLflow names the runs (hydra_plugins/gaexp_regimes)
    assert (c.regime.batch_size, c.regime.num_accum, c.regime.replicas) == bkw and c.regime.name == name
    assert c.run_name == f"bn-{name}-s1" and c.regime.samples == bkw[0] * bkw[1] * bkw[2]


@pytest.mark.parametrize("name,hint", [("w1b4a4", "; one replica's name is bs4a4"), ("bs0a1", ""), ("bs01a4", ""),
                                       ("w2b8", ""), ("fast", "")])
def test_other_regime_names_are_refused_in_one_line(name, hint):
    assert unknown_choice([f"regime=bs1a16,{name}"]) == (
        f"regime={name}: no such regime; valid: bs16a1, bs1a1, bs1a16, bs4a4, or any bsBaK or wWbBaK (w >= 2){hint}")
    assert unknown_choice(["regime=bs1a16,bs3a5,w2b8a1"]) is None  # a sweep of mixed pairs is written as it reads


def test_the_regime_source_serves_gaexp_alone(tmp_path):
    """Another Hydra app in the same environment has no regime source on its search path; gaexp has."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    def providers(config_dir: str) -> list[str]:
        with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
            return [e.provider for e in GlobalHydra.instance().config_loader().get_search_path().get_path()]
    (tmp_path / "config.yaml").write_text("x: 1\n")
    assert "gaexp-regimes" not in providers(str(tmp_path)) and "gaexp-regimes" in providers(CONFIG_DIR)


def test_the_data_group_names_the_dataset_in_tags_and_names(compose):
    c = typed(compose("data=fashion_mnist", "norm=gn4", "regime=bs1a16", "seed=3"))
    assert (c.data.dataset, c.data.torchvision, c.data.sources) == ("fashion_mnist", "FashionMNIST",
                                                                    ["local", "torchvision", "debian"])
    assert c.data.files["t10k-labels-idx1-ubyte"] == "15d484375f8d13e6eb1aabb0c3f46965" and c.data.pypi is None
    assert c.run_name == "fashion_mnist-gn4-bs1a16-s3"  # never the name of an MNIST cell
    assert typed(compose("norm=gn4", "regime=bs1a16", "seed=3")).run_name == "gn4-bs1a16-s3"


def test_the_model_group_names_the_model_in_names_and_leads_after_the_dataset(compose):
    c = typed(compose("model=resnet20", "norm=gn4", "regime=bs1a16", "seed=3"))
    assert (c.model.name, c.model.target, c.model.cost) == ("resnet20", "gaexp.model:ResNet20", 6.0)
    assert c.run_name == "resnet20-gn4-bs1a16-s3"
    assert typed(compose("model=resnet20", "data=fashion_mnist", "norm=gn4")).run_name == "fashion_mnist-resnet20-gn4-bs16a1-s1"
    assert typed(compose("model=custom", "model.target=m:f", "model.name=mynet")).run_name == "mynet-bn-bs16a1-s1"
    assert typed(compose("model=resnet20", "accumulate=batched")).run_name == "resnet20-batched-bn-bs16a1-s1"
    assert typed(compose("accumulate=loop", "norm=gn4")).run_name == "gn4-bs16a1-s1"  # the loop keeps its names
    with pytest.raises(ValueError, match=r"^model.target has no value; set it on the command line \(model.target=...\): "
                                         r"module:callable taking norm_layer, in_channels, num_classes"):
        typed(compose("model=custom"))  # never the simple model's default in its place
    with pytest.raises(ConfigCompositionException) as info:
        compose("model=resnet")
    assert all(name in str(info.value) for name in ("resnet", "custom", "resnet20", "simple"))


def test_unknown_norm_is_rejected_with_the_choices(compose):
    with pytest.raises(ConfigCompositionException) as info:
        compose("norm=batchnorm")
    message = str(info.value)
    assert "batchnorm" in message and all(name in message for name in NORM_CHOICES)
    assert "plain" not in message  # the schemas live in their own group, never offered as a choice


# Composition refuses wrong types and unknown keys, naming the key; ranges (and keys forced in with +)
# are checked when the config becomes objects, naming the key, the value and what is valid.
COMPOSE_ERRORS = {
    "type": (["regime.batch_size=abc"], "regime.batch_size"),
    "unknown key": (["norm=bn", "norm.groups=4"], "Could not override 'norm.groups'"),
    "option of another norm": (["norm=bn", "norm.r_max=2"], "Could not override 'norm.r_max'"),
}


@pytest.mark.parametrize("case", list(COMPOSE_ERRORS))
def test_composition_refuses_wrong_types_and_unknown_keys(case, compose):
    overrides, message = COMPOSE_ERRORS[case]
    with pytest.raises(ConfigCompositionException) as info:
        compose(*overrides)
    assert message in str(info.value) + str(info.value.__cause__)


RANGE_ERRORS = {
    "batch size": (["regime.batch_size=0"], r"regime.batch_size=0; valid: an integer >= 1"),
    "engine": (["accumulate=ghost"], r"^accumulate='ghost'; valid: loop, batched, cached, auto$"),
    "accumulation": (["regime.num_accum=-2"], r"regime.num_accum=-2; valid: an integer >= 1"),
    "iterations": (["train.num_iterations=0"], r"train.num_iterations=0; valid: an integer >= 1"),
    "eval period": (["train.eval_period=0"], r"train.eval_period=0; valid: an integer >= 1"),
    "learning rate": (["train.lr=-1"], r"train.lr=-1.0; valid: a finite number > 0"),
    "infinite lr": (["train.lr=inf"], r"train.lr=inf; valid: a finite number > 0"),
    "device": (["device=tpu"], r"device='tpu'; valid: auto, cpu, cuda"),
    "compile": (["compile=true"], r"compile='True'; valid: auto, off, eval, all"),
    "threads": (["threads=many"], r"threads='many'; valid: auto or an integer >= 0"),
    "file store": (["mlflow.tracking_uri=./mlruns"], r"mlflow.tracking_uri='./mlruns'; valid: sqlite:///"),
    "groups": (["norm=gn", "norm.groups=0"], r"norm.groups=0; valid: an integer >= 1"),
    "r_max": (["norm=brn", "norm.r_max=0.5"], r"norm.r_max=0.5; valid: a finite number >= 1.0"),
    "momentum": (["norm=bn_kmom", "norm.momentum=1.5"], r"norm.momentum=1.5; valid: a number in \(0, 1\]"),
    "stats samples": (["norm=bn_precise", "norm.stats_samples=0"], r"norm.stats_samples=0; valid: an integer >= 1"),
    "reference": (["analysis.reference=bs1a1"], r"analysis.reference='bs1a1'; valid: one of analysis.table_columns"),
    "key forced in": (["norm=bn", "+norm.groups=4"], r"norm.groups is not a key of norm=bn; valid: name$"),
    "top key forced in": (["+lr=0.1"], r"lr is not a key of the config; valid: task, model, norm, regime, precision, seed, device, device_type, deterministic, train, "),
    "nested key forced in": (["+train.learning_rate=0.1"], r"train.learning_rate is not a key of train; valid: "
                                                            r"num_iterations, eval_period, lr, loss_window, eval_batch_size"),
}


@pytest.mark.parametrize("case", list(RANGE_ERRORS))
def test_ranges_and_forced_keys_are_checked_when_the_config_becomes_objects(case, compose):
    overrides, message = RANGE_ERRORS[case]
    cfg = compose(*overrides)  # types are right: composition accepts it
    with pytest.raises(ValueError, match=message):
        typed(cfg)


def test_a_micro_batch_option_of_the_wrong_type_is_refused(compose):
    with pytest.raises(ConfigCompositionException) as info:
        compose("norm=bn_microeval", "norm.micro_batch=2.5")
    assert "norm.micro_batch" in str(info.value) + str(info.value.__cause__)


def test_runtime_mark_derives_the_protocol_and_the_folder_names(compose):
    runtime = runtime_keys()
    assert {"threads", "compile", "rerun", "progress", "cells_at_once", "paths.outputs", "data.root", "data.sources",
            "mlflow.tracking_uri", "mlflow.experiment_name", "analysis.window_start", "optuna.trial"} <= set(runtime)
    assert {"data.torchvision", "data.files", "data.num_train", "data.pypi", "data.debian", "data.kind", "data.path",
            "data.target", "data.params", "data.shape", "data.num_classes", "data.max_memory_mb"} <= set(runtime)
    assert not {"seed", "device", "device_type", "train.lr", "regime.batch_size", "data.dataset",
                "data.holdout"} & set(runtime)
    assert "deterministic" in runtime
    assert PROTOCOL_COLUMNS == ["task.name", "task.loss", "task.balance", "task.balance_coef", "task.negatives",
                                "task.temperature", "task.features", "task.projection", "task.knn_k", "task.knn_bank",
                                "model.name", "model.target", "precision.autocast", "precision.weights",
                                "precision.accumulate_in", "precision.scaler", "precision.name", "device", "device_type", "train.num_iterations", "train.eval_period", "train.lr", "train.loss_window",
                                "train.eval_batch_size", "accumulate", "data.dataset", "data.size", "data.channels",
                                "data.mean", "data.std", "data.augment", "data.digest", "data.context", "data.packed",
                                "data.separator", "data.holdout"]
    excluded = compose(hydra=True).hydra.job.config.override_dirname.exclude_keys
    # a sweep folder's name, and an Optuna study's identity, leave out the runtime keys but those deciding what a
    # trial returns
    assert list(excluded) == ["launch", "experiment", *(k for k in runtime if k not in OBJECTIVE_KEYS)]
    assert set(OBJECTIVE_KEYS) == {"analysis.objective", "analysis.window_start"} <= set(runtime)
    # the loop's run (auto's runs are keyed with the engine they resolve to: tests/test_engine.py)
    resolved = OmegaConf.to_container(compose("norm=gn", "regime=bs4a4", "device=cpu", "accumulate=loop"), resolve=True)
    assert set(protocol_part(resolved)) == {"norm", "regime", "seed", "device", "train"}  # data.holdout=0, cpu: out
    assert protocol_part(resolved)["norm"] == {"name": "gn", "groups": 8}
    held_out = OmegaConf.to_container(compose("norm=gn", "regime=bs4a4", "device=cpu", "data.holdout=10000"),
                                      resolve=True)
    assert protocol_part(held_out)["data"] == {"holdout": 10000}
    assert tracking.protocol_key(held_out) != tracking.protocol_key(resolved)
    fashion = OmegaConf.to_container(compose("norm=gn", "regime=bs4a4", "device=cpu", "data=fashion_mnist"),
                                     resolve=True)
    assert protocol_part(fashion)["data"] == {"dataset": "fashion_mnist"}  # mnist, the first dataset: left out
    assert tracking.protocol_key(fashion) != tracking.protocol_key(resolved)
    resnet = OmegaConf.to_container(compose("norm=gn", "regime=bs4a4", "device=cpu", "model=resnet20"), resolve=True)
    assert protocol_part(resnet)["model"] == {"name": "resnet20", "target": "gaexp.model:ResNet20"}  # cost: runtime
    assert tracking.protocol_key(resnet) != tracking.protocol_key(resolved)
    batched = OmegaConf.to_container(compose("norm=gn", "regime=bs4a4", "device=cpu", "accumulate=batched"),
                                     resolve=True)
    assert protocol_part(batched)["accumulate"] == "batched" and "accumulate" not in protocol_part(resolved)
    assert tracking.protocol_key(batched) != tracking.protocol_key(resolved)


PROTOCOL_KEY_GN4_BS4A4 = "0a648bac67732a7c"  # tag protocol_key of gn4-bs4a4-s1, 40 steps, recorded by d106f35


def test_protocol_key_is_unchanged_for_runs_recorded_before_the_schema(compose, monkeypatch):
    """A config as the untyped conf/ composed it (before the schema, with no cells_at_once or analysis)
    keeps its key, so existing stores still resume. Digest taken from a run recorded by that version."""
    before = {"norm": {"name": "gn4"}, "regime": {"batch_size": 4, "num_accum": 4}, "seed": 1, "device": "auto",
              "threads": "auto", "compile": False, "rerun": False, "progress": None,
              "train": {"num_iterations": 40, "eval_period": 20, "lr": 0.001, "loss_window": 100, "eval_batch_size": 256},
              "paths": {"outputs": "/x"}, "data": {"root": "/x/data", "sources": ["local"]},
              "mlflow": {"tracking_uri": "sqlite:////x/mlflow.db", "experiment_name": "gaexp",
                         "artifact_location": "/x/mlartifacts", "stale_after_s": 3600}}
    now = {**before, "cells_at_once": 2, "analysis": {"window_start": 0}}
    assert tracking.protocol_key(before) == tracking.protocol_key(now) == PROTOCOL_KEY_GN4_BS4A4
    today = compose("norm=gn4", "regime=bs4a4", "train.num_iterations=40", "train.eval_period=20",
                    "accumulate=loop")  # the engine those runs ran (accumulate=auto finds them: engine.keys)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # device=auto on a CPU, as those runs were
    assert tracking.protocol_key(OmegaConf.to_container(today, resolve=True)) == PROTOCOL_KEY_GN4_BS4A4  # data=mnist
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the same command where a GPU is seen
    on_gpu = OmegaConf.to_container(today, resolve=True)
    assert on_gpu["device_type"] == "cuda" and protocol_part(on_gpu)["device_type"] == "cuda"
    assert tracking.protocol_key(on_gpu) != PROTOCOL_KEY_GN4_BS4A4  # never resumes from, or pools with, CPU runs


@pytest.mark.parametrize("device, gpu_seen, expected", [
    ("auto", False, "cpu"), ("auto", True, "cuda"), ("cpu", True, "cpu"), ("cuda", False, "cuda")])
def test_device_type_is_the_device_resolved_where_the_run_runs(device, gpu_seen, expected, compose, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu_seen)
    c = typed(compose(f"device={device}"))
    assert (c.device, c.device_type) == (device, expected)



def test_the_docs_key_table_is_generated_from_the_schema():
    page = (REPO / DOCS_PAGE).read_text()
    block = re.search(r"<!-- config-keys:begin -->\n(.*?)\n<!-- config-keys:end -->", page, re.S)
    assert block, f"{DOCS_PAGE} lost its config-keys markers"
    assert block.group(1) == markdown_table(), "regenerate it: make docs"
    assert all(f"| `{key}` |" in block.group(1) for key in runtime_keys())


OPTUNA, GRID = "hydra_plugins.gaexp_optuna_sweeper", "hydra_plugins.gaexp_grid_sweeper"
# Every module of gaexp and of its Hydra plugins, bottom first: each imports (at its top or inside a function) only
# modules before it. The plugins' shared names and the trial side gaexp calls sit at the bottom; their sweepers and
# launcher, which Hydra loads and nothing imports, at the top, above the app they never import.
WING = {name: [*(f"{name}.{m}" for m in modules), name] for name, modules in {  # a package's modules, bottom up,
    "config": ("keys", "schema", "protocol", "overrides", "resolvers"),             # then the package, which names
    "tracking": ("store", "search", "record", "resume", "inputs", "models"),       # their public names
    "progress": ("cost", "account", "sweep", "live", "status", "__main__"),
    "analysis": ("columns", "collection", "stats", "figures", "tables", "reporting", "__main__")}.items()}
CHECK = ("errors", "evidence", "trees", "state", "recorder", "loss", "numerics", "report", "randomness", "step",
         "coupling", "terms", "remedies", "accumulation", "balance", "negatives", "hf", "first_step", "hf_callback",
         "lightning_callback")  # the check wing, bottom up (gaexp/check/__init__.py)
LAYERS = [f"{OPTUNA}._errors", f"{OPTUNA}.config", f"{OPTUNA}.trials", f"{OPTUNA}.tally", f"{GRID}.config",
          *(f"gaexp.{m}" for m in [
              "machine", "redact", "arguments", *WING["config"], "metrics", "tags", "study", "configdocs", "targets",
              "data.catalog", "data.limits", "data.batches", "data.torchvision_sets", "data.idx", "data.folder",
              "data.custom", "data.text", "data.dataset", "data", "data.__main__", "optim", "precision", "task", "task.classify",
              "task.lm", "task.contrastive", "task.build", "hooks", "liveness", "faults", "trial", "layers", "gpt",
              "norms", "model", "memory", "batched", "cached", "replicas", "engine", "train", "team", *(f"check.{m}" for m in CHECK), "check", *WING["tracking"], "cell",
              "tools.storegen", "tools.server", *WING["progress"], "breakdown", "tools.eta_replay", "tuning", *WING["analysis"],
              "tools.ui", "compare", "tools.storebench", "tools.bench", "tools.drift", "check.cli", "check.__main__", "tools.zoo", "tools.hf_zoo",
              "tools.gpucheck", "callbacks", "app", "__main__"]),
          f"{OPTUNA}._space", f"{OPTUNA}._protocol", f"{OPTUNA}._heartbeat", f"{OPTUNA}._impl",
          f"{OPTUNA}.sweeper", f"{GRID}.sweeper", f"{GRID}.failed", f"{GRID}.task_watch", f"{GRID}.submitit_launcher", f"{GRID}.joblib_launcher",
          "hydra_plugins.gaexp_regimes.source"]
WINGS = {"gaexp.data": ("gaexp.config", "gaexp.targets"),  # a wing's modules import these of gaexp and their own wing
         "gaexp.check": ("gaexp.config", "gaexp.precision", "gaexp.norms"),  # (its command, check.cli, anything below)
         "gaexp.tools": None}  # None: anything below; but nothing outside the wing imports it
COMMANDS = ("gaexp.check.cli", "gaexp.check.__main__")  # a wing's command, above it
THE_APP = ("gaexp.app", "gaexp.callbacks", "gaexp.__main__")  # what no plugin imports


def _without_main_block(tree: ast.Module) -> ast.Module:
    """The module without its `if __name__ == "__main__":` block: an entry point, not a dependency (`python -m
    gaexp.data` starts the command of the datasets of every kind, which sits above the IDX files' module)."""
    def is_main(node: ast.stmt) -> bool:
        return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
                and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__")
    tree.body = [node for node in tree.body if not is_main(node)]
    return tree


def imported_modules(tree: ast.Module, known: list[str]) -> set[str]:
    """The modules of `known` that `tree` imports, wherever (its top, a function): `import a.b`, `from a.b import
    c` (a.b.c when that is a module), `from a import b`."""
    names = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            names |= {alias.name for alias in n.names}
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            names |= {n.module} | {f"{n.module}.{alias.name}" for alias in n.names}
    return {name for name in names if name in known}


def module_name(path: Path) -> str:
    """gaexp.data.idx for gaexp/data/idx.py; gaexp.config for gaexp/config/__init__.py (a package that names its modules'
    names: importing it imports them)."""
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_path(module: str) -> Path:
    path = REPO / module.replace(".", "/")
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def imports_anything(path: Path) -> bool:
    return any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(ast.parse(path.read_text())))


def test_imports_point_down_and_no_plugin_imports_the_app():
    """Each module of gaexp and of its plugins imports only modules below it (LAYERS: no cycle, no upward
    import), and no plugin imports the app."""
    found = sorted([module_name(p) for p in (REPO / "gaexp").rglob("*.py")  # the root package registers the config only
                    if p.stem != "__init__" or (imports_anything(p) and p.parent.name != "gaexp")] +
                   [f"hydra_plugins.{p.parent.name}.{p.stem}" for p in (REPO / "hydra_plugins").glob("gaexp_*/*.py")
                    if p.stem != "__init__"])
    assert found == sorted(LAYERS)
    for module in LAYERS:
        tree = _without_main_block(ast.parse(module_path(module).read_text()))
        imported = imported_modules(tree, LAYERS)
        above = sorted(m for m in imported if LAYERS.index(m) >= LAYERS.index(module))
        assert not above, f"{module} imports {above}, which sit above it"
        if module.startswith("hydra_plugins."):
            assert not imported & set(THE_APP), f"{module} imports the app: {sorted(imported & set(THE_APP))}"
        for wing, allowed in WINGS.items():
            if module.startswith(wing + ".") and module not in COMMANDS:
                outside = sorted(m for m in imported if not m.startswith(wing + ".") and allowed is not None
                                 and m.startswith("gaexp.") and m not in allowed)
                assert not outside, f"{module}, of the wing {wing}, imports {outside} of the app"
            elif not module.startswith(wing + "."):
                inside = sorted(m for m in imported if m.startswith(wing + "."))
                assert allowed is not None or not inside, f"{module} imports the tools {inside}"


def test_no_module_at_the_packages_root_only_forwards_to_another():
    """Each module at gaexp/'s root declares something of its own: none is only imports and a call of another's code
    (a command's old name kept alive beside its new one). The package's own `python -m gaexp` is the exception."""
    for path in sorted((REPO / "gaexp").glob("*.py")):
        if path.name in ("__init__.py", "__main__.py"):
            continue
        body = [node for node in ast.parse(path.read_text()).body
                if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))]  # the docstring
        own = [node for node in body if not isinstance(node, (ast.Import, ast.ImportFrom, ast.If))]
        assert own, f"gaexp/{path.name} only forwards to another module: serve its name from one place"


def test_the_cpu_kind_names_the_model_and_the_instruction_set_torchs_kernels_use(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Gold 6338 CPU\nflags\t: fpu\n")
    assert cpu_kind(info) == f"Intel(R) Xeon(R) Gold 6338 CPU ({torch.backends.cpu.get_cpu_capability()})"
    assert cpu_kind(tmp_path / "absent").endswith(f" ({torch.backends.cpu.get_cpu_capability()})")  # macOS: no file


@pytest.mark.parametrize("files, cpus", [
    ({"cpu.max": "max 100000\n"}, None),                     # cgroup v2, no quota
    ({"cpu.max": "200000 100000\n"}, 2),                     # docker --cpus=2
    ({"cpu.max": "150000 100000\n"}, 2),                     # 1.5 CPUs: rounded up, never 0
    ({"cpu.max": "50000 100000\n"}, 1),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),   # cgroup v1, no quota
    ({"cpu/cpu.cfs_quota_us": "400000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 4),
    ({}, None),                                               # no cgroup file system (macOS, old kernels)
    ({"cpu.max": "garbage\n"}, None),
])
def test_cgroup_quota_is_read_from_v2_or_v1_files(files, cpus, tmp_path):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_cpus(tmp_path) == cpus


@pytest.mark.parametrize("cpus, quota, slurm_cpus, usable", [
    (1, None, None, 1), (2, None, None, 2), (8, None, None, 8), (16, None, None, 16), (64, None, None, 64),
    (64, 2, None, 2),        # a container limited to 2 CPUs on a 64-core host
    (64, 0.5, None, 1),      # half a CPU still runs one thread
    (2, 8, None, 2),         # a quota above the mask does not add CPUs
    (64, None, 4, 4),        # a SLURM task on a node that does not bind CPUs
    (64, 2, 8, 2), (16, 8, 4, 4),
])
def test_usable_cores_is_the_smallest_of_mask_quota_and_slurm(cpus, quota, slurm_cpus, usable, machine):
    machine(cpus, quota, slurm_cpus)
    assert usable_cores() == usable


@pytest.mark.parametrize("overrides,message", [
    (["norm=gn5"], "norm=gn5: no such norm; valid: bn, bn_kmom, bn_microeval, bn_precise, bn_sync, brn, custom, gn, gn16, gn4, "
                   "in, in_affine, ln, none; for GroupNorm with 5 groups: norm=gn norm.groups=5"),
    (["-m", "norm=bn,gn4", "regime=bs1a16,w1b2a8"], "regime=w1b2a8: no such regime; valid: bs16a1, bs1a1, bs1a16, "
                                                    "bs4a4, or any bsBaK or wWbBaK (w >= 2); one replica's name is bs2a8"),
    (["+experiment=spce"], "+experiment=spce: no such experiment; valid: bn_fixes, contrastive, dp, lm, moe, precision, spec, spec_cifar10, spec_resnet20, "
                           "tune_lr"),
    (["data=cifar"], "data=cifar: no such data; valid: cifar10, cifar100, custom, fashion_mnist, fortunes, imagefolder, mnist, svhn, textfolder"),
    (["norm=gn", "norm.groups=5", "regime.batch_size=2", "regime.num_accum=8", "train.lr=0.1", "data.path=/x",
      "+data.params.n=3", "hydra.launcher.n_jobs=2", "launch=joblib", "model=custom", "model.target=a:b"], None),
    (["hydra.searchpath=[file:///my/conf]", "norm=my_norm"], None),  # files this cannot see
])
def test_an_unknown_choice_or_key_is_one_line_with_what_it_means(overrides, message):
    assert unknown_choice(overrides) == message


@pytest.mark.parametrize("overrides,message", [
    (["train.lrr=0.1"], "train.lrr: no key 'lrr' in train; valid: num_iterations, eval_period, lr, loss_window, "
                        "eval_batch_size (did you mean train.lr?)"),
    (["-m", "norm=bn,gn", "norm.groups=4"], "norm.groups: no key 'groups' in norm=bn; valid: name"),
    (["norm=gn", "norm.groupz=4"], "norm.groupz: no key 'groupz' in norm=gn; valid: name, groups (did you mean "
                                   "norm.groups?)"),
    (["hydra.sweeper.grid.norm=bn"], "hydra.sweeper.grid.norm: no key 'grid' in hydra.sweeper; valid: max_batch_size, "
                                     "params, order, progress, poll_s"),
    (["data.params.n=3"], "data.params.n: a new key of a dict; add it with +data.params.n=..."),
    (["regime.batch_size=abc"], "Error merging override regime.batch_size=abc: Value 'abc' of type 'str' could not be "
                                "converted to Integer"),
    (["-m", "hydra/sweeper=gaexp_optuna", "+hydra.sweeper.grid.norm='bn,gn4'", "train.lr=tag(log, interval(1e-4, 1e-2))",
      "norm=bn,gn4", "seed=1,2"], None),
])
def test_a_key_hydra_would_refuse_in_many_lines_is_one(overrides, message):
    assert composition_problem(hydra_overrides(overrides)) == message


def test_the_command_refuses_an_unknown_choice_in_one_line_before_hydra_starts(monkeypatch):
    """`gaexp norm=gn5` (and `python -m gaexp`, the same function): one line, Hydra's main never reached."""
    from gaexp import app

    monkeypatch.setattr(app, "main", lambda: pytest.fail("Hydra started on an unknown choice"))
    with pytest.raises(SystemExit) as stop:
        app.cli(["-m", "norm=gn5", "seed=1,2"])
    assert str(stop.value) == ("error: norm=gn5: no such norm; valid: bn, bn_kmom, bn_microeval, bn_precise, bn_sync, brn, custom, "
                               "gn, gn16, gn4, in, in_affine, ln, none; for GroupNorm with 5 groups: norm=gn norm.groups=5")
    with pytest.raises(SystemExit, match=r"^error: train.lrr: no key 'lrr' in train; valid: "):
        app.cli(["train.lrr=0.1"])
    ran = []
    monkeypatch.setattr(app, "main", lambda: ran.append(True))
    app.cli(["-m", "norm=gn", "norm.groups=5", "seed=1,2"])
    assert ran == [True]


PRECISION_ERRORS = {
    "sum of fp32 weights": (["precision=bf16", "precision.accumulate_in=fp32"],
                            r"^precision.accumulate_in='fp32'; valid: param with precision.weights=fp32 "),
    "autocast over bf16 weights": (["precision=bf16w", "precision.autocast=fp16"],
                                   r"^precision.autocast='fp16'; valid: none with precision.weights=bf16 "),
    "a name of one's own": (["precision=bf16", "precision.name=mine"],
                            r"^precision.name='mine'; valid: bf16, what its keys make "),
    "weights": (["precision.weights=fp16"], r"^precision.weights='fp16'; valid: fp32, bf16$"),
    "autocast": (["precision.autocast=fp8"], r"^precision.autocast='fp8'; valid: none, bf16, fp16$"),
}


@pytest.mark.parametrize("case", list(PRECISION_ERRORS))
def test_a_precision_its_keys_cannot_make_is_refused_naming_what_is_valid(case, compose):
    overrides, message = PRECISION_ERRORS[case]
    with pytest.raises(ValueError, match=message):
        typed(compose(*overrides))


def test_precision_is_a_group_named_by_its_keys_and_fp32_keeps_every_key_and_name(compose):
    assert unknown_choice(["precision=fp8"]) == ("precision=fp8: no such precision; valid: bf16, bf16w, bf16w-acc32, "
                                                 "fp16, fp32")
    for name in ("fp32", "bf16", "fp16", "bf16w", "bf16w-acc32"):  # each file's name is what its keys make
        assert typed(compose(f"precision={name}")).precision.name == name
    assert typed(compose("precision=fp16", "precision.scaler=false")).precision.name == "fp16-noscaler"
    fp32 = OmegaConf.to_container(compose("norm=gn4", "regime=bs4a4", "device=cpu"), resolve=True)
    before = {k: v for k, v in fp32.items() if k != "precision"}  # as runs were recorded before the group
    assert "precision" not in protocol_part(fp32)
    assert tracking.protocol_key(fp32) == tracking.protocol_key(before)
    bf16 = OmegaConf.to_container(compose("norm=gn4", "regime=bs4a4", "device=cpu", "precision=bf16"), resolve=True)
    assert protocol_part(bf16)["precision"] == {"autocast": "bf16", "name": "bf16"}
    assert tracking.protocol_key(bf16) != tracking.protocol_key(fp32)
    assert typed(compose("norm=gn4", "regime=bs4a4")).run_name == "gn4-bs4a4-s1"
    assert typed(compose("norm=gn4", "regime=bs4a4", "precision=bf16w-acc32", "accumulate=batched",
                         "model=resnet20")).run_name == "resnet20-batched-bf16w-acc32-gn4-bs4a4-s1"
