"""accumulate=cached (gaexp/cached.py, GradCache) and a loss over the whole step's outputs, proven in float64 on
MNIST's images through the contrastive task (gaexp/task/contrastive.py): the study's CNN as the encoder, its
projection head, two views of each image.

- With a per-sample encoder, the cached step at (b, k) is the big batch's step (bk, 1), and so is the loop's
  (each micro-batch's graph held until the step's one loss) and the batched engine's.
- Naive accumulation (negatives=micro) is not, and what differs is the negatives alone: its step is exactly the
  step of the mean of the micro-batches' InfoNCE taken on the big batch's outputs.
- With BatchNorm, the cached step is the loop's (each micro-batch normalized by its own statistics in both passes,
  running statistics updated once per micro-batch), and not the big batch's (the step's statistics).
- Dropout draws the same masks in both passes (the RNG state restored).
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
from torch import nn

from gaexp.config import GroupNormConfig, NormConfig, TaskConfig
from gaexp.data.batches import VIEWS, micro_batches
from gaexp.model import SimpleModel
from gaexp.norms import norm_layer
from gaexp.task.build import make as make_task
from gaexp.task.contrastive import Contrastive, Embedder, info_nce
from gaexp.train import step_function
from tests.conftest import Float64

B, K = 4, 4  # micro-batches of 4 images (8 views), 4 a step: the big batch is 16 images (32 views)
# float64 rounding: measured up to 3.3e-15 relative between engines; computing another loss differs by > 1e-3
TOLERANCE = 1e-9
LOSS = 1e-6  # the loop sums its micro-batches' losses in a float32 total: the returned loss is float32


def encoder(norm: str, seed: int = 0) -> nn.Module:
    config = GroupNormConfig(name="gn", groups=4) if norm == "gn4" else NormConfig(name=norm)
    torch.manual_seed(seed)
    return Float64(Embedder(SimpleModel(norm_layer(config), 1, 32), 32, 16))


def views(split):
    return replace(split, augment=VIEWS)


def step(engine, model, data, b, k, task, seed=3):
    """The gradients (flattened) and the loss of one step of `engine` over the seed's first b*k images."""
    model.zero_grad(set_to_none=True)
    batches = micro_batches(len(data), b, seed, data.augment)
    loss = step_function(engine, model, b, task.views)(model, data, batches, k, None, task)
    return torch.cat([p.grad.flatten() for p in model.parameters()]), loss


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def data(train_split):
    return views(train_split.take(slice(0, 256)))


@pytest.mark.parametrize("norm", ["none", "gn4"])
def test_with_a_per_sample_encoder_every_engine_of_negatives_step_computes_the_big_batchs_step(data, norm):
    task = Contrastive("step")
    model = encoder(norm)
    big, big_loss = step("loop", model, data, B * K, 1, task)
    for engine in ("cached", "loop", "batched"):
        grad, loss = step(engine, model, data, B, K, task)
        assert relative(grad, big) < TOLERANCE, engine
        assert loss.item() == pytest.approx(big_loss.item(), rel=LOSS), engine


def test_naive_accumulation_differs_from_the_big_batch_by_its_negatives_alone(data):
    """negatives=micro at (b, k): not the big batch's step (each view has 2b - 2 negatives, not 2bk - 2), and
    exactly the step of the big batch's outputs under the mean of the micro-batches' own InfoNCE."""
    model = encoder("none")
    big, _ = step("loop", model, data, B * K, 1, Contrastive("step"))
    naive, naive_loss = step("loop", model, data, B, K, Contrastive("micro"))
    assert relative(naive, big) > 1e-3
    model.zero_grad(set_to_none=True)
    batches = micro_batches(len(data), B * K, 3, data.augment)
    inputs, targets = data.batch(next(batches))
    explained = Contrastive("micro").chunked_loss(model(inputs), targets, K)  # the same outputs, negatives split
    explained.backward()
    grad = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert relative(naive, grad) < TOLERANCE
    assert naive_loss.item() == pytest.approx(explained.item(), rel=LOSS)
    # and the cached engine computes the micro objective as exactly as the step's
    cached, _ = step("cached", model, data, B, K, Contrastive("micro"))
    assert relative(cached, naive) < TOLERANCE


def test_with_batchnorm_the_cached_step_is_the_loops_with_each_micro_batchs_statistics_not_the_big_batchs(data):
    task = Contrastive("step")
    loop_model, cached_model = encoder("bn"), encoder("bn")
    loop, _ = step("loop", loop_model, data, B, K, task)
    cached, _ = step("cached", cached_model, data, B, K, task)
    assert relative(cached, loop) < TOLERANCE
    for mine, theirs in zip(cached_model.buffers(), loop_model.buffers()):  # updated once per micro-batch, in order
        assert torch.allclose(mine, theirs, rtol=TOLERANCE, atol=0)
    tracked = [b for name, b in cached_model.named_buffers() if name.endswith("num_batches_tracked")]
    assert tracked and all(int(b) == K for b in tracked)
    batched_model = encoder("bn")  # one pass, BatchNorm chunked by a micro-batch's 2b rows: the loop's step too
    batched, _ = step("batched", batched_model, data, B, K, task)
    assert relative(batched, loop) < TOLERANCE
    big_model = encoder("bn")
    big, _ = step("loop", big_model, data, B * K, 1, task)
    assert relative(cached, big) > 1e-3  # the step's statistics are another computation


def test_dropout_draws_the_same_masks_in_both_passes(data):
    task = Contrastive("step")

    def dropping() -> nn.Module:
        model = encoder("none")
        model.model.head.insert(1, nn.Dropout(0.5))
        return model

    held, cached = dropping(), dropping()
    torch.manual_seed(11)
    loop_grad, _ = step("loop", held, data, B, K, task)
    after_loop = torch.rand(())
    torch.manual_seed(11)
    cached_grad, _ = step("cached", cached, data, B, K, task)
    assert relative(cached_grad, loop_grad) < TOLERANCE
    assert torch.rand(()) == after_loop  # the RNG left where the loop leaves it


def test_the_views_of_a_sample_are_the_same_whatever_the_regime(data):
    """The n-th image of the stream gets the same two views whether it comes in micro-batches of 4 or 16; its two
    views differ (each its own crop and flip), and the rows of the model's input are image i's at 2i and 2i + 1."""
    small = [data.batch(d)[0] for d in itertools.islice(micro_batches(len(data), 4, 5, VIEWS), 4)]
    big = data.batch(next(micro_batches(len(data), 16, 5, VIEWS)))[0]
    assert torch.equal(torch.cat(small), big) and big.shape == (32, 1, 28, 28)
    assert not torch.equal(big[0], big[1])
    index = next(micro_batches(len(data), 16, 5, VIEWS)).index
    plain = data.images[index].float().div(255)
    assert torch.equal(big[0::2].sum(dim=(1, 2, 3)) > 0, plain.sum(dim=(1, 2, 3)) > 0)


def test_info_nce_is_the_twins_cross_entropy_over_the_other_views():
    torch.manual_seed(0)
    z = torch.randn(6, 5, dtype=torch.float64)
    unit = z / z.norm(dim=1, keepdim=True)
    expected = []
    for i in range(6):
        others = [j for j in range(6) if j != i]
        logits = torch.stack([unit[i] @ unit[j] / 0.5 for j in others])
        expected.append(-torch.log_softmax(logits, 0)[others.index(i ^ 1)])
    assert info_nce(z, 0.5).item() == pytest.approx(torch.stack(expected).mean().item(), rel=1e-12)


def test_the_cached_engine_refuses_a_loss_that_reads_the_model_and_replicas():
    from gaexp import engine

    moe = make_task(TaskConfig(name="lm", loss="step_token_mean", balance="global"))
    with pytest.raises(ValueError, match=r"^accumulate=cached: its loss reads the model beyond its outputs .*; valid: "
                                         r"accumulate=loop, batched or auto$"):
        engine.choose("cached", nn.Linear(2, 2), 4, 4, None, lambda e: None, task=moe)
    with pytest.raises(ValueError, match=r"^accumulate=cached: regime.replicas=2: each replica"):
        engine.choose("cached", nn.Linear(2, 2), 4, 4, None, lambda e: None, task=Contrastive("step"), replicas=2)


def test_auto_takes_batched_where_the_step_fits_and_cached_where_it_does_not():
    from gaexp import engine

    task = Contrastive("step")
    fits = engine.choose("auto", nn.Linear(2, 2), 8, 8, 60000, lambda e: None, task=task)
    tight = engine.choose("auto", nn.Linear(2, 2), 8, 8, 60000, lambda e: "a step needs 9 GiB", task=task)
    micro = engine.choose("auto", nn.Linear(2, 2), 8, 8, 60000, lambda e: "a step needs 9 GiB",
                          task=Contrastive("micro"))
    alone = engine.choose("auto", nn.Linear(2, 2), 64, 1, 60000, lambda e: "a step needs 9 GiB", task=task)
    assert (fits.engine, tight.engine, micro.engine, alone.engine) == ("batched", "cached", "loop", "loop")
    assert engine.notice(tight, "bn-bs8a8-s1") == ("bn-bs8a8-s1: accumulate=auto trains with the cached engine: a "
                                                   "step's 64 samples at once do not fit: a step needs 9 GiB")


def test_the_cached_engine_with_one_micro_batch_is_the_loops_step(data):
    """k = 1: nothing to cache, one forward (the loop's step, bit for bit); k > 1: two forwards of each micro-batch."""
    task, calls = Contrastive("step"), []
    model = encoder("gn4")
    model.register_forward_hook(lambda *_: calls.append(1))
    loop, _ = step("loop", model, data, 16, 1, task)
    cached, _ = step("cached", model, data, 16, 1, task)
    assert torch.equal(cached, loop) and len(calls) == 2
    step("cached", model, data, B, K, task)
    assert len(calls) == 2 + 2 * K


def test_which_engines_hold_the_whole_steps_activations():
    """What the memory check counts and `batched_activation_mb` records: batched always, the loop for a loss over the
    step's outputs over k > 1 (every graph held to the step's loss), the cached engine never."""
    from gaexp.memory import holds_step
    step, micro = Contrastive("step"), Contrastive("micro")
    assert [holds_step(e, step, 8) for e in ("loop", "batched", "cached")] == [True, True, False]
    assert [holds_step(e, micro, 8) for e in ("loop", "batched", "cached")] == [False, True, False]
    assert not holds_step("loop", step, 1)
