"""Is a training step safe to accumulate? One step taken both ways from the same weights, measured.

`check_accumulation` runs one training step as one batch of b*k samples and as k micro-batches of b (each
micro-batch loss scaled by 1/k, as gaexp's loop does), from the same weights and the same samples, and says
what differs and why:

- the gradients, per parameter tensor and overall (relative difference), against a float-rounding threshold;
- the modules that couple the samples of a batch: each module is called again on its own recorded input,
  micro-batch by micro-batch, and its outputs compared with the full batch's (so a module is named for what it
  does itself, not for what reached it from upstream; a module is tested whole only when none of its
  submodules couples, which also finds couplings written in a parent's `forward`). Each tensor is split along
  the axis that carries the samples, traced by comparing the shapes the module saw in the whole batch's
  forward and in a micro-batch's: a sequence-first layer is split along its second axis, and a module whose
  tensors carry no such axis is listed as untested, never as coupling;
- the buffers that end the step differently (BatchNorm's running statistics: k updates instead of one);
- the loss: its gradient with respect to the model's outputs, the full batch's outputs split in k, both ways
  (a mean over a count that varies between micro-batches, in-batch negatives), and which of the two it is; a loss
  computed in the model's forward (transformers' `outputs.loss`, `aux_loss`), which no split of the outputs can
  tell, term by term through the model (terms.py), with a router's auxiliary loss over the batch as a third kind.

Random modules are found by what their own code does, not by what reaches the output: a module whose own
`forward` draws from torch's, Python's or NumPy's random stream (dropout, stochastic depth, `F.dropout` or a
drop-path in a parent's `forward`), whatever its probability and however small its effect, and then a module
whose output differs between two calls on the same input (a generator of its own). Each is checked with its
own training flag off (as in evaluation), and the report names it and how it was found, so the verdict does
not depend on the seed. NaN or Inf in the inputs, a module's output, the loss or a gradient ends the check
(`NonFiniteError`, naming where it first appeared): a non-finite step is never safe. The model is left as it
was: parameters, buffers, `.grad`, training flags and the random streams.

All of that is measured in float32, whatever precision the model will train in, so rounding can never pass for a
coupling. Under a precision (`precision=`: gaexp's bf16, fp16, bf16w, bf16w-acc32, as gaexp/precision.py computes
them), `precision_drift` then takes the same step, with the same modes, on copies: as k micro-batches summed as
that precision sums them and as one batch, each against the same step in float64, and says whether accumulation
is measurably further from float64 than the big batch (`measurably_worse`), and what to change.

Nothing here knows about Hydra, MLflow or gaexp's datasets, and gaexp's own study only as the figures its remedies cite
(evidence.py). The wing, bottom up: errors, evidence, trees (batches as nested structures), state (kept and given
back), recorder (one forward recorded, a mutable argument such as a KV cache kept as a copy), loss, numerics (under
a precision), report (and `render`), randomness, step, coupling, terms, remedies, accumulation
(`check_accumulation`); hf (transformers models and their tasks' inputs, offline), first_step and the trainers'
callbacks (hf_callback, lightning_callback: transformers and Lightning imported there only); cli is the command
around it, `gaexp-check` (`python -m gaexp.check`).
"""

from gaexp.check.accumulation import MODES, check_accumulation
from gaexp.check.errors import CheckError, NonFiniteError
from gaexp.check.loss import (LOSS_FORMS, MODEL_LOSS, NUM_ITEMS, STEP_TARGETS, LossContract, count_items, cross_entropy,
                              loss_contract)
from gaexp.check.numerics import PrecisionDrift, measurably_worse, precision_drift
from gaexp.check.report import BufferDiff, Coupling, LossTerm, RandomModule, Report, TensorDiff, render

__all__ = ["BufferDiff", "CheckError", "Coupling", "LOSS_FORMS", "LossContract", "LossTerm", "MODEL_LOSS", "MODES",
           "NUM_ITEMS", "NonFiniteError", "PrecisionDrift", "RandomModule", "Report", "STEP_TARGETS", "TensorDiff",
           "check_accumulation", "count_items", "cross_entropy", "loss_contract", "measurably_worse", "precision_drift",
           "render"]
