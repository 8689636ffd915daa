"""A task: what a model is trained to do, seen by the engines and the report only through this contract (in the
spirit of Lightning's LightningModule, whose trainer knows no task).

A task declares
- its headline (`metrics.Headline`): the one evaluation result that ranks runs, with its direction, scale and unit;
- its loss and how the loss normalizes over the samples of a step (`normalization`):
  - `MICRO`: the loss is a mean over each micro-batch's items. The engine averages the k micro-batches' means
    (each scaled by 1/k). This is exact under accumulation when every micro-batch counts the same items
    (images, sequences); otherwise it is what naive accumulation computes, and it is the task's choice to say so;
  - `STEP`: the loss is a sum over the items, divided by the count of the whole step's items, which the engine
    counts before any backward (`count`, as transformers' `num_items_in_batch` and torchtitan's
    `global_valid_tokens`). Exact under accumulation by construction.
  - `OUTPUTS`: the loss is one function of the whole step's outputs, not a sum over its micro-batches (a contrastive
    loss whose negatives are the step's views). The loop holds the step's graphs until that one loss; the batched
    engine computes it in its one pass; the cached engine (gaexp/cached.py) at one micro-batch's memory.
- its evaluation: named metrics, the headline's first;
- what it makes of the network and the data (`width`, `model`, `training_split`, `prepare`): by default the
  network as built, its output one logit per class, and the training split as the data gives it.

The engines (gaexp/train.py, gaexp/batched.py, gaexp/cached.py) call `loss`, `step_loss` and `count`; tracking, progress and
Optuna read the `EvalPoint`'s metrics by name; the report reads the headline (`headline_of`). A run's task is
built from its config by gaexp/task/build.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Sequence

from gaexp.metrics import ACCURACY, TOKEN_LOSS, Headline, Metric

if TYPE_CHECKING:
    import torch

    from gaexp.data.batches import Split
    from gaexp.precision import Precision

MICRO, STEP, OUTPUTS = "micro", "step", "outputs"
CLASSIFY, LM, CONTRASTIVE = "classify", "lm", "contrastive"
# torch-free: the report reads these (a contrastive run's valid_acc is its k-NN classifier's)
HEADLINES: Mapping[str, Headline] = {CLASSIFY: ACCURACY, LM: TOKEN_LOSS, CONTRASTIVE: ACCURACY}


class Task:
    """The contract; a task subclasses it (gaexp/task/classify.py, gaexp/task/lm.py)."""

    name: str
    normalization: str = MICRO
    step_pass: bool = False  # the loop calls `begin_step` before a step's first backward
    speed: Metric | None = None  # the training speed in the task's own items, beside samples/s (the data's `items`)
    views: int = 1  # the model's input rows per sample (a contrastive task's two views of each image)
    reads_model: bool = False  # the loss reads the model beyond its outputs (an MoE's routing): not cached's

    @property
    def whole_step(self) -> bool:
        """Whether the loop reads the whole step's micro-batches before its first backward (to count the step's
        items, or for `begin_step`); otherwise it makes each micro-batch as it comes."""
        return self.normalization == STEP or self.step_pass

    @property
    def split_free(self) -> bool:
        """Whether a step's loss is the same however the step is split into micro-batches, under an engine that
        computes it in one pass (gaexp/batched.py): a mean over every item of the step (the default `chunked_loss`),
        a sum over the step's count, or one loss of the whole step's outputs; never a loss that reads the model
        beyond its outputs (an MoE's balance per micro-batch). Cells that differ only in their split then compute the
        same steps (gaexp/engine.py `arithmetic_key`)."""
        if self.reads_model:
            return False
        return self.normalization != MICRO or type(self).chunked_loss is Task.chunked_loss

    @property
    def whole_outputs(self) -> bool:
        """Whether the loss is one function of the whole step's outputs (OUTPUTS), not a sum over micro-batches."""
        return self.normalization == OUTPUTS

    @property
    def headline(self) -> Headline:
        return HEADLINES[self.name]

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """MICRO: the mean loss over these items; STEP: their summed loss; OUTPUTS: the loss of these outputs taken as
        a whole (float32, whatever the forward's dtype)."""
        raise NotImplementedError

    def chunked_loss(self, outputs: torch.Tensor, targets: torch.Tensor, parts: int) -> torch.Tensor:
        """MICRO, from one pass over `parts` equal consecutive micro-batches (the batched engine): the mean of their
        `loss`es. This default is exact where every item of a micro-batch weighs the same (the mean over all)."""
        return self.loss(outputs, targets)

    def step_loss(self, outputs: torch.Tensor, targets: torch.Tensor, parts: int) -> torch.Tensor:
        """The step's loss from the outputs of its `parts` micro-batches in order, in one tensor (the batched and
        cached engines): MICRO, the mean of their `loss`es (`chunked_loss`); STEP, the sum over the step's count;
        OUTPUTS, the loss of the whole step."""
        if self.normalization == MICRO:
            return self.chunked_loss(outputs, targets, parts)
        if self.normalization == STEP:
            return self.loss(outputs, targets) / self.count(targets)
        return self.loss(outputs, targets)

    def width(self, num_classes: int) -> int:
        """The network's output width for data of `num_classes` classes: one logit per class."""
        return num_classes

    def model(self, network: torch.nn.Module) -> torch.nn.Module:
        """The module trained, from the network the model config builds: the network itself."""
        return network

    def training_split(self, split: Split) -> Split:
        """The training split as the task draws it (a contrastive task's: two views of each image)."""
        return split

    def prepare(self, train_data: Split) -> None:
        """Before training: what evaluation needs of the training split (a k-NN classifier's labeled bank)."""

    def attach(self, model: torch.nn.Module) -> None:
        """Before training `model` (and when a cell's config is checked): find what the loss reads of the model
        besides its outputs (an MoE's routing); a model without it is refused in one line (ValueError)."""

    def begin_step(self, forward: torch.nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The loop, before a step's first backward, under no_grad and the training's autocast, where `step_pass`:
        what the loss needs of the whole step beyond its targets (an MoE's routing counted over the step)."""

    def extra(self, targets: torch.Tensor, part: int, parts: int) -> torch.Tensor | None:
        """The loop: a term added to micro-batch `part` of `parts`' normalized loss, already normalized (an MoE's
        balancing loss), read from that micro-batch's forward; None: none."""
        return None

    def chunked_extra(self, targets: torch.Tensor, parts: int) -> torch.Tensor | None:
        """The batched engine: the sum of `extra` over the `parts` micro-batches of one pass."""
        return None

    def count(self, targets: torch.Tensor) -> torch.Tensor:
        """STEP: the items these targets count, as a tensor (the step's count is the sum over its micro-batches)."""
        raise NotImplementedError

    def probe(self, shape: tuple[int, ...], num_classes: int, samples: int = 2
              ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
        """(inputs, targets, the model's expected output shape) of `samples` blank samples of the data's `shape`:
        what checks a model against the data (gaexp/model.py) and measures its memory per sample."""
        raise NotImplementedError

    def evaluate(self, model: torch.nn.Module, data: Split, batch_size: int, precision: Precision) -> dict[str, float]:
        """The named metrics of `model` on the whole split, in eval mode, the headline's first."""
        raise NotImplementedError


def headline_of(name: str) -> Headline:
    """The headline of a recorded run's task (`task.name`; runs from before tasks: classify)."""
    if name not in HEADLINES:
        raise ValueError(f"task.name={name!r}; valid: {', '.join(HEADLINES)}")
    return HEADLINES[name]
