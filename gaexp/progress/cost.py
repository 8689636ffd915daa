"""The cost model of a cell: its expected seconds on one core (training, evaluation and a cell's fixed cost, under its
precision and its replicas), and the graphs it compiles (`graph_keys`), in evaluation graphs' worth.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from gaexp.config import FP32
from gaexp.study import TEST_IMAGES
from gaexp.tags import (ACCUMULATE, BATCH_SIZE, COMPILED, DATASET, DEVICE, MODEL, NORM, NUM_ACCUM, PRECISION, REPLICAS,
                        SAME_AS)


# One core of the 2-core machine, compile=auto (the 60-cell grid and the ETA's figures, docs/results.md):
# a micro-batch of b trains forward and backward in MICRO_S * b**BATCH_EXPONENT s, Adam's step takes STEP_S,
# evaluation EVAL_IMAGE_S per image; a cell's run costs CELL_S more (its records, its model saved) and
# GAP_S passes between one cell's end and the next one's start on the same worker (its config, data and
# model made). An evaluation graph compiled with no cache costs GRAPH_S, a training graph (forward and
# backward) TRAIN_GRAPH graphs' worth. The cells that finished rescale these. accumulate=batched trains a step's
# b*k samples in one pass (MICRO_S * (b*k)**BATCH_EXPONENT) and draws its k micro-batches at DRAW_S each (the
# batched grid: 1375 samples/s at bs1a16 against 1583 at bs16a1, docs/results.md).
MICRO_S, BATCH_EXPONENT, STEP_S, EVAL_IMAGE_S, DRAW_S = 2.6e-3, 0.7, 1.8e-3, 2.5e-4, 1.0e-4


CELL_S, GAP_S, GRAPH_S, TRAIN_GRAPH = 1.0, 1.0, 9.0, 1.5


# A precision's training and evaluation against float32's with the same engine, on a CPU with bf16 instructions
# (docs/results.md, "The precision study", 2026-12-04): bf16 at float32's speed within the noise, bf16w-acc32 0.9x its
# cost (the study's cells beside bf16's), bf16w's loop 1.2x (its loop cells beside bf16's batched ones, in this
# model's units), fp16 (emulated on that CPU) 10x (200-step cells beside float32's: 9.9x, 11.7x). A precision not
# named here, and any on a GPU, costs as float32; on a CPU that emulates bf16 (several times slower), the cells
# that finish correct the speed (fit_rates).
PRECISION_COST = {"bf16": 1.0, "bf16w": 1.2, "bf16w-acc32": 0.9, "fp16": 10.0}


def expected_seconds(batch_size: int, num_accum: int, num_iterations: int, eval_period: int,
                     valid_images: int = TEST_IMAGES, model_cost: float = 1.0, accumulate: str = "loop",
                     precision_cost: float = 1.0) -> float:
    """A cell's expected seconds on one core of the reference machine, compilation of new graphs left out;
    `model_cost` (model.cost) scales the simple CNN's times to another model's, `precision_cost`
    (`precision_cost()`) float32's to the cell's precision; `accumulate`: the engine, loop (k passes of b samples
    a step) or batched (one pass of b*k)."""
    evaluations = num_iterations // eval_period + (num_iterations % eval_period > 0)
    if accumulate == "batched":
        step = MICRO_S * (batch_size * num_accum) ** BATCH_EXPONENT + num_accum * DRAW_S + STEP_S
    else:
        step = num_accum * MICRO_S * batch_size ** BATCH_EXPONENT + STEP_S
    return CELL_S + model_cost * precision_cost * (num_iterations * step + evaluations * valid_images * EVAL_IMAGE_S)


def precision_cost(precision: str, device_type: str) -> float:
    """`PRECISION_COST` of the precision named as runs record it (the `precision` tag, precision.name), on the
    device type the cell trains on."""
    return PRECISION_COST.get(precision, 1.0) if device_type == "cpu" else 1.0


def replica_work(num_accum: int, replicas: int) -> int:
    """The micro-batches of b a step computes over all its replicas: w replicas of k cost the cores what
    accumulation's w*k does (and count as w cores when cells share a machine)."""
    return num_accum * replicas


def graph_keys(phases: Iterable[str], model: str, dataset: str, norm: str, batch_size: int,
               accumulate: str) -> frozenset[tuple[str, ...]]:
    """The graphs a cell compiles (`phases`: "train", "eval"): evaluation's depend on the model, data
    and norm, training's on the batch size and the engine too. Cells that share one share Inductor's cache."""
    keys = {("eval", model, dataset, norm)} if "eval" in phases else set()
    if "train" in phases:
        keys.add(("train", model, dataset, norm, str(batch_size), accumulate))
    return frozenset(keys)


def graph_units(keys: Iterable[tuple[str, ...]]) -> float:
    """Compilations in evaluation graphs' worth."""
    return sum(TRAIN_GRAPH if key[0] == "train" else 1.0 for key in keys)


def run_seconds(tags: Mapping[str, str], params: Mapping[str, str]) -> float:
    """`expected_seconds` of a cell's run, from its tags and logged config (w replicas: their core-seconds, as
    `replica_work` counts them); a run that records another's steps (SAME_AS), its records alone (CELL_S)."""
    if SAME_AS in tags:
        return CELL_S
    return expected_seconds(int(tags[BATCH_SIZE]), replica_work(int(tags[NUM_ACCUM]), int(tags.get(REPLICAS, 1))),
                            int(params["train.num_iterations"]),
                            int(params["train.eval_period"]), int(params.get("data.holdout", 0)) or TEST_IMAGES,
                            float(params.get("model.cost", 1.0)), tags.get(ACCUMULATE, "loop"),
                            precision_cost(tags.get(PRECISION, FP32), tags.get(DEVICE, "cpu")))


def run_graphs(tags: Mapping[str, str]) -> frozenset[tuple[str, ...]]:
    """`graph_keys` of a cell's run, from its tags (`compiled`: what it compiled; a shared run: nothing)."""
    if SAME_AS in tags:
        return frozenset()
    phases = [] if tags.get(COMPILED, "off") == "off" else tags[COMPILED].split(",")
    return graph_keys(phases, tags.get(MODEL, ""), tags.get(DATASET, ""), tags.get(NORM, ""),
                      int(tags.get(BATCH_SIZE, 0)), tags.get(ACCUMULATE, "loop"))
