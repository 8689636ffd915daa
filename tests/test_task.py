"""The tasks' arithmetic under accumulation, in float64 on a small decoder and sequences of varied length: the loss
normalized by the step's token count is the big batch's at any (b, k); the micro-batch token mean is the loop's sum
of per-micro-batch means, and not the big batch's; the batched and cached engines compute each choice as the loop does
(the cached engine's two passes serve any loss of the outputs); a packed corpus makes the token mean exact."""

from __future__ import annotations

import functools

import pytest
import torch

from gaexp.batched import Chunking, accumulate_batched
from gaexp.cached import accumulate_cached
from gaexp.data.batches import micro_batches
from gaexp.data.text import TextSplit, sequences
from gaexp.gpt import gpt
from gaexp.norms import norm_layer
from gaexp.task import MICRO, STEP
from gaexp.task.classify import Classify
from gaexp.task.lm import IGNORE, LanguageModel, token_losses
from gaexp.train import accumulate

CONTEXT, SEED = 24, 3


def corpus(packed: bool = False) -> TextSplit:
    """64 documents of 3 to 60 bytes (cut to CONTEXT + 1 tokens): sequences of varied length, as text has them."""
    g = torch.Generator().manual_seed(0)
    docs = [bytes(torch.randint(97, 123, (int(n),), generator=g).tolist())
            for n in torch.randint(3, 60, (64,), generator=g)]
    tokens, lengths = sequences(docs, CONTEXT, packed)
    return TextSplit(tokens, lengths)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return gpt(norm_layer("ln"), 1, 256, context=CONTEXT, layers=1, width=16, heads=2).double()


def gradient(step, data: TextSplit, b: int, k: int, task) -> tuple[torch.Tensor, torch.Tensor]:
    """(the step's returned loss, its gradient flattened) of the first step at (b, k)."""
    net = model()
    step_fn = functools.partial(step, chunking=Chunking(net, b)) if step is accumulate_batched else step
    loss = step_fn(net, data, micro_batches(len(data), b, SEED), k, None, task)
    return loss, torch.cat([p.grad.flatten() for p in net.parameters()])


def by_hand(data: TextSplit, b: int, k: int, per_micro) -> torch.Tensor:
    """The gradient of (1/k) * sum over the k micro-batches of `per_micro`(their token losses, targets)."""
    net = model()
    draws = micro_batches(len(data), b, SEED)
    total = sum(per_micro(*(lambda x, y: (token_losses(net(x), y), y))(*data.batch(next(draws)))) for _ in range(k))
    (total / k).backward()
    return torch.cat([p.grad.flatten() for p in net.parameters()])


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool((a - b).norm() <= 1e-12 * b.norm())


def test_the_corpus_has_sequences_of_varied_length_and_padding_is_never_a_target():
    data = corpus()
    _, targets = data.batch(next(micro_batches(len(data), 16, SEED)))
    counts = (targets != IGNORE).sum(1)
    assert counts.min() < 10 and counts.max() == CONTEXT  # short and cut documents in one micro-batch
    assert ((data.images[:, 0, 0, 1:] == 0) == (targets_all := data.window(slice(None))[1] == IGNORE)).all()
    assert targets_all.any()


@pytest.mark.parametrize("step", [accumulate, accumulate_batched, accumulate_cached], ids=["loop", "batched", "cached"])
def test_the_step_token_mean_at_b_k_is_the_big_batchs_step(step):
    task, data = LanguageModel("step_token_mean"), corpus()
    assert task.normalization == STEP
    loss, big = gradient(accumulate, data, 16, 1, task)
    for b, k in ((4, 4), (1, 16), (8, 2)):
        got_loss, got = gradient(step, data, b, k, task)
        assert close(got, big), (b, k)
        assert abs(got_loss - loss) <= 1e-6 * loss  # the loop sums the micro-batches' losses in float32


@pytest.mark.parametrize("step", [accumulate, accumulate_batched, accumulate_cached], ids=["loop", "batched", "cached"])
def test_the_token_mean_at_b_k_is_the_mean_of_micro_batch_means_not_the_big_batchs(step):
    task, data = LanguageModel("token_mean"), corpus()
    assert task.normalization == MICRO
    for b, k in ((4, 4), (1, 16)):
        _, got = gradient(step, data, b, k, task)
        assert close(got, by_hand(data, b, k, lambda losses, y: losses.sum() / (y != IGNORE).sum()))
        _, big = gradient(accumulate, data, b * k, 1, task)
        assert (got - big).norm() > 1e-3 * big.norm()  # short micro-batches' tokens weigh more: not the big batch


@pytest.mark.parametrize("step", [accumulate, accumulate_batched, accumulate_cached], ids=["loop", "batched", "cached"])
def test_the_sequence_mean_is_exact_under_accumulation(step):
    task, data = LanguageModel("seq_mean"), corpus()
    _, big = gradient(accumulate, data, 16, 1, task)
    _, got = gradient(step, data, 4, 4, task)
    assert close(got, big)
    assert close(got, by_hand(data, 4, 4, lambda losses, y: (losses.sum(1) / (y != IGNORE).sum(1)).mean()))


def test_packing_makes_the_token_mean_exact():
    task, data = LanguageModel("token_mean"), corpus(packed=True)
    assert (data.labels == CONTEXT + 1).all()
    _, big = gradient(accumulate, data, 8, 1, task)
    _, got = gradient(accumulate, data, 2, 4, task)
    assert close(got, big)


def test_an_unknown_loss_is_one_line_naming_the_valid_ones():
    with pytest.raises(ValueError, match=r"^task.loss='mean'; valid for task=lm: token_mean, step_token_mean, "
                                         r"seq_mean$"):
        LanguageModel("mean")


def test_the_evaluation_weighs_every_token_the_same_in_batches_of_any_size():
    task, data, net = LanguageModel("token_mean"), corpus(), model()
    from gaexp.precision import Precision
    whole = task.evaluate(net, data, 64, Precision.float32())
    assert task.evaluate(net, data, 5, Precision.float32())["valid_loss"] == pytest.approx(whole["valid_loss"], rel=1e-12)
    x, y = data.window(slice(None))
    with torch.no_grad():
        expected = token_losses(net(x), y).sum() / (y != IGNORE).sum()
    assert whole["valid_loss"] == pytest.approx(expected.item(), rel=1e-12)
    assert list(whole) == ["valid_loss", "valid_ppl"] and whole["valid_ppl"] == pytest.approx(torch.exp(expected).item())
    assert (task.headline.metric.name, task.headline.higher_is_better) == ("valid_loss", False)
    assert (Classify().headline.metric.name, Classify().headline.higher_is_better) == ("valid_acc", True)


def test_a_search_maximizes_an_accuracy_and_minimizes_a_language_models_loss():
    from gaexp.trial import check_direction, describe_objective
    from gaexp.config import AnalysisConfig
    check_direction("maximize")
    check_direction("minimize", "lm")
    with pytest.raises(ValueError, match=r"^hydra.sweeper.direction=maximize: a gaexp trial of task=lm returns a "
                                         r"validation loss \(valid_loss\) \(analysis.objective\); valid: "
                                         r"hydra.sweeper.direction=minimize$"):
        check_direction("maximize", "lm")
    with pytest.raises(ValueError, match=r"valid: hydra.sweeper.direction=maximize$"):
        check_direction("minimize")
    assert describe_objective(AnalysisConfig(window_start=9), "lm") == (
        "window: mean valid_loss over the evaluations at step > 9 (the report's metric)")


def moe() -> torch.nn.Module:
    from gaexp.gpt import gpt_moe
    torch.manual_seed(0)
    return gpt_moe(norm_layer("ln"), 1, 256, context=CONTEXT, layers=2, width=16, heads=2, experts=4, top_k=2).double()


def moe_gradient(step, data: TextSplit, b: int, k: int, task) -> torch.Tensor:
    net = moe()
    task.attach(net)
    step_fn = functools.partial(step, chunking=Chunking(net, b)) if step is accumulate_batched else step
    step_fn(net, data, micro_batches(len(data), b, SEED), k, None, task)
    return torch.cat([p.grad.flatten() for p in net.parameters()])


def balancing(balance: str) -> LanguageModel:
    return LanguageModel("step_token_mean", balance, coef=1.0)  # a large coefficient: the balance's part shows


@pytest.mark.parametrize("step", [accumulate, accumulate_batched], ids=["loop", "batched"])
def test_the_global_balance_at_b_k_is_the_big_batchs_and_the_micro_balance_is_not(step):
    data = corpus()
    big = moe_gradient(accumulate, data, 16, 1, balancing("global"))
    assert close(moe_gradient(accumulate, data, 16, 1, balancing("micro")), big)  # one micro-batch: one balance
    without = moe_gradient(accumulate, data, 16, 1, LanguageModel("step_token_mean"))
    assert (big - without).norm() > 1e-3 * big.norm()  # the balancing loss is in the gradient
    for b, k in ((4, 4), (2, 8)):
        assert close(moe_gradient(step, data, b, k, balancing("global")), big), (b, k)
        micro = moe_gradient(step, data, b, k, balancing("micro"))
        assert (micro - big).norm() > 1e-4 * big.norm(), (b, k)  # each micro-batch balanced: not the step


@pytest.mark.parametrize("balance", ["micro", "running"])
def test_the_batched_engine_balances_as_the_loop_does(balance):
    data = corpus()
    loop = moe_gradient(accumulate, data, 4, 4, balancing(balance))
    assert close(moe_gradient(accumulate_batched, data, 4, 4, balancing(balance)), loop)
    other = "running" if balance == "micro" else "micro"
    assert (moe_gradient(accumulate, data, 4, 4, balancing(other)) - loop).norm() > 1e-6 * loop.norm()


def test_the_micro_balance_is_each_micro_batchs_own_switch_loss_by_hand():
    """N * sum_i f_i * P_i over a micro-batch's predicted tokens, f_i the fraction of its routings to expert i and
    P_i its mean router probability, averaged over the MoE layers and the k micro-batches."""
    data, task = corpus(), balancing("micro")
    net = moe()
    task.attach(net)
    draws = micro_batches(len(data), 4, SEED)
    by_hand, got = 0.0, 0.0
    for j in range(4):
        x, y = data.batch(next(draws))
        net(x)
        mask = (y != IGNORE)
        terms = []
        for layer in task.routers:
            probs, chosen = (t[mask] for t in layer.routing)  # [tokens, experts]
            terms.append(4 * ((chosen.mean(0) / 2) * probs.mean(0)).sum())  # 4 experts, 2 chosen a token
        by_hand = by_hand + torch.stack(terms).mean() / 4
        got = got + task.extra(y, j, 4)
    assert abs(got - by_hand) <= 1e-12 * by_hand


def test_a_balance_without_experts_is_one_line():
    with pytest.raises(ValueError, match=r"^task.balance=global balances a mixture of experts' router, and the model "
                                         r"has none; valid: model=gpt_moe, or task.balance=none$"):
        LanguageModel("step_token_mean", "global").attach(model())
