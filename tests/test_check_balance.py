"""The check's wrapper of a gaexp MoE (gaexp/check/balance.py), in float64: its k micro-batches' losses, each scaled by
1/k as the check scales them, give the loop's step for each loss and balance; its whole step gives the big batch's;
and a call with rows out of the step's order is still its micro-batch."""

from __future__ import annotations

import pytest
import torch

from gaexp.check.balance import Balanced, rows_at
from gaexp.data.batches import micro_batches
from gaexp.task import STEP
from gaexp.task.lm import LanguageModel
from gaexp.train import accumulate
from tests.test_task import SEED, close, corpus, moe

B, K = 2, 4


def loop_gradient(task: LanguageModel, b: int, k: int) -> torch.Tensor:
    net = moe()
    task.attach(net)
    accumulate(net, corpus(), micro_batches(len(corpus()), b, SEED), k, None, task)
    return torch.cat([p.grad.flatten() for p in net.parameters()])


def wrapper_gradient(task: LanguageModel, order: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the gradient of the check's way: micro-batches `order` of the step, each loss / K; the sum of their
    aux_loss / K)."""
    net, data = moe(), corpus()
    tokens, targets = data.batch(next(micro_batches(len(data), B * K, SEED)))
    wrapped = Balanced(net, task, tokens, targets, task.normalization == STEP)
    aux = torch.zeros((), dtype=torch.float64)
    for j in order:
        rows = slice(j * B, (j + 1) * B)
        out = wrapped(tokens[rows], targets[rows])
        (out["loss"] / (K if len(order) > 1 else 1)).backward()
        aux += out["aux_loss"].detach() / (K if len(order) > 1 else 1)
    return torch.cat([p.grad.flatten() for p in net.parameters()]), aux


@pytest.mark.parametrize("loss", ["step_token_mean", "token_mean"])
@pytest.mark.parametrize("balance", ["micro", "global", "running"])
def test_the_wrapped_micro_batches_are_the_loops_step(balance, loss):
    """The corpus's draws at b * k = 8 are the first micro-batch of 8 and the first four of 2 (one permutation)."""
    task = LanguageModel(loss, balance, coef=1.0)
    loop = loop_gradient(task, B, K)
    assert close(wrapper_gradient(task, [0, 1, 2, 3])[0], loop)
    if balance != "running":  # any order: each call is its rows' micro-batch
        assert close(wrapper_gradient(task, [2, 0, 3, 1])[0], loop)
    else:  # the counts so far follow the step's order, whatever the calls'
        assert close(wrapper_gradient(task, [3, 1, 0, 2])[0], loop)


@pytest.mark.parametrize("balance", ["micro", "global", "running"])
def test_the_wrapped_whole_step_is_the_big_batchs(balance):
    task = LanguageModel("step_token_mean", balance, coef=1.0)
    net, data = moe(), corpus()
    tokens, targets = data.batch(next(micro_batches(len(data), B * K, SEED)))
    out = Balanced(net, task, tokens, targets, task.normalization == STEP)(tokens, targets)
    out["loss"].backward()
    assert close(torch.cat([p.grad.flatten() for p in net.parameters()]), loop_gradient(task, B * K, 1))
    assert out["aux_loss"].item() > 0


def test_the_balancing_term_apart_is_what_differs():
    """micro against global: the same token loss, different balancing terms."""
    micro = wrapper_gradient(LanguageModel("step_token_mean", "micro", coef=1.0), [0, 1, 2, 3])
    exact = wrapper_gradient(LanguageModel("step_token_mean", "global", coef=1.0), [0, 1, 2, 3])
    assert (micro[0] - exact[0]).norm() > 1e-4 * exact[0].norm()
    assert micro[1] != exact[1]


def test_rows_are_found_where_they_sit_in_the_step():
    step = torch.arange(24).view(6, 4)
    assert rows_at(step, step[2:4]) == 2 and rows_at(step, step) == 0
    assert rows_at(step, step[[1, 3]]) is None and rows_at(step, step[:, :2]) is None
