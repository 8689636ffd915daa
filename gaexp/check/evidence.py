"""What gaexp's own study measured for BatchNorm at micro-batch 1 x 16 accumulation steps, which the remedies cite
(docs/results.md, "The remedies": the study's CNN on MNIST, full protocol, mean valid accuracy over 3 seeds, and the
paired difference to the true batch of 16, bn/bs16a1, with its 95% t-interval and its verdict at ±0.5 points).
These are figures, not logic: tests/test_check.py holds them to that table, and what each remedy changes is its
norm's declaration (gaexp/norms.py: `remedy`, and `in_your_model` for a model of one's own).
"""

from __future__ import annotations


# What gaexp's own study measured for BatchNorm at micro-batch 1 x 16 accumulation steps (docs/results.md,
# "The remedies": the study's CNN on MNIST, full protocol, mean valid accuracy over 3 seeds, and the paired
# difference to the true batch of 16, bn/bs16a1, with its 95% t-interval and its verdict at ±0.5 points).
# tests/test_check.py holds these figures to that table.
BN_ACCUMULATED = ("bn", 88.70, "-8.94 [-16.05, -1.83]", "worse")


# What each changes is its norm's declaration (gaexp/norms.py: `remedy`, and `in_your_model` for a model of
# one's own, where gaexp's norm= choices do not apply).
BN_REMEDIES = (  # (norm= choice, accuracy %, points against the true batch, verdict), best first
    ("bn_microeval", 98.41, "+0.77 [+0.64, +0.90]", "better"),
    ("in", 98.47, "+0.83 [+0.52, +1.15]", "better"),
    ("brn", 97.55, "-0.10 [-0.74, +0.55]", "inconclusive (4 seeds)"),
    ("gn16", 97.31, "-0.33 [-1.21, +0.56]", "inconclusive (7 seeds)"),
    ("bn_precise", 90.65, "-6.99 [-10.83, -3.16]", "worse"),
)


# What gaexp's language-model study measured for the token mean normalized per micro-batch (docs/results.md,
# "Language models": model=gpt on data=fortunes, 2,000 steps, validation loss per token over 3 seeds, the paired
# difference to the big batch of 16 sequences with its 95% t-interval and verdict at ±0.02 nats).
LM_TOKEN_MEAN = ("token_mean", "bs1a16", 2.185, "+0.038 [+0.019, +0.057]", "worse")

# What gaexp's MoE study measured for the balancing loss counted per micro-batch and as a running count (docs/results.md,
# "Mixtures of experts": model=gpt_moe as above, its loss over the step's count, balance coefficient 0.01; the same
# columns). Counted over the step (global), every regime's loss was the true batch's, bit for bit.
LM_BALANCE = (("micro", "bs1a16", 2.108, "+0.004 [-0.073, +0.081]", "inconclusive (13 seeds)"),
              ("running", "bs1a16", 2.145, "+0.041 [-0.148, +0.231]", "inconclusive (16 seeds)"))

STUDY_GROUPS = 16  # the GroupNorm remedy's group count as measured (gn16); fewer where 16 does not divide C

# What gaexp's contrastive study measured (docs/results.md, "Contrastive learning: in-batch negatives": the study's CNN
# with a projection head on MNIST, SimCLR's InfoNCE, 64 images a step, the k-NN accuracy over 3 seeds, the paired
# difference to the true batch of 64 with its 95% t-interval and verdict at ±1 point), for each norm and whose
# negatives at 8 x 8 under the cached engine: (row, regime, accuracy %, points against the true batch, verdict).
CONTRASTIVE_NEGATIVES = (("bn-step", "bs8a8", 80.52, "+0.24 [-0.30, +0.78]", "equivalent"),
                         ("bn-micro", "bs8a8", 77.03, "-3.24 [-5.28, -1.20]", "worse"),
                         ("gn4-step", "bs8a8", 75.18, "-0.31 [-0.98, +0.35]", "equivalent"),
                         ("gn4-micro", "bs8a8", 72.67, "-2.83 [-6.16, +0.50]", "inconclusive (4 seeds)"),
                         ("none-step", "bs8a8", 58.41, "-2.86 [-5.32, -0.40]", "worse"),
                         ("none-micro", "bs8a8", 45.28, "-16.00 [-27.73, -4.26]", "worse"))
