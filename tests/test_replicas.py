"""gaexp/replicas.py: data parallelism's step proven in float64 with real gloo processes (the study's CNN, real
MNIST images): with per-sample norms, w replicas of b with k steps are the loop over the step's w*b*k samples; with
per-replica BatchNorm they are accumulation at (b, w*k) (Goyal et al. 2017's footnote), not the big batch; with
synchronized BatchNorm at k = 1 they are one batch of w*b, not accumulation. One gradient all-reduce per optimizer
step, counted by a communication hook. The batched engine under DDP computes the loop's step. Rank 0 hosts the
store, as a cell does; the faults a cell meets (a replica that fails or dies) are tests/test_replicas_cell.py's."""

from __future__ import annotations

import itertools
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gaexp import norms, replicas
from gaexp.data.batches import Split, micro_batches
from gaexp.model import SimpleModel
from gaexp.train import accumulate, step_function

SEED = 3
SAMPLES = 48  # images of real MNIST the steps draw from


def make_model(norm: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return SimpleModel(norms.norm_layer(norm)).double()


def flat_grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _replica(rank: int, world: int, port: int, norm: str, b: int, k: int, engine: str, steps: int,
             data: Split, out: str) -> None:
    """One replica: `steps` steps of its micro-batches under DDP (no optimizer: the gradients of step 1 are
    compared; later steps count the all-reduces). Every warning its steps raise is kept."""
    torch.set_num_threads(1)
    store = dist.TCPStore(replicas.HOST, port, world, False)
    group = replicas.join(rank, world, store, torch.device("cpu"))
    model = make_model(norm)
    ddp = group.wrap(model)
    calls = []  # (step, bucket) of each gradient all-reduce

    def counting(state, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        calls.append((step, bucket.index()))
        return allreduce_hook(None, bucket)
    ddp.register_comm_hook(None, counting)
    gradient = step_function(engine, model, b)
    draws = replicas.replica_draws(micro_batches(len(data), b, SEED), rank, world, k)
    first = None
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        for step in range(steps):
            gradient(ddp, data, draws, k)
            first = flat_grads(model) if first is None else first
            model.zero_grad(set_to_none=True)
    if rank == 0:
        torch.save({"grad": first, "calls": calls, "warned": [str(w.message) for w in warned]}, out)
    group.close()


def replicated(tmp_path: Path, data: Split, norm: str, w: int, b: int, k: int, engine: str = "loop",
               steps: int = 1) -> dict:
    """Rank 0's result of `w` gloo processes, started as a cell starts its replicas (spawn)."""
    out = tmp_path / f"{norm}-w{w}b{b}a{k}-{engine}-{steps}.pt"
    store, _ = replicas.open_store(w + 1)  # the test's process hosts it, as rank 0 of a cell does; it never joins
    torch.multiprocessing.start_processes(_replica, args=(w, store.port, norm, b, k, engine, steps, data, str(out)),
                                          nprocs=w, start_method="spawn")
    return torch.load(out)


def looped(data: Split, norm: str, b: int, k: int) -> torch.Tensor:
    """One process, the loop: the gradient of a step of k micro-batches of b."""
    model = make_model(norm)
    accumulate(model, data, micro_batches(len(data), b, SEED), k)
    return flat_grads(model)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def data(train_split: Split) -> Split:
    return Split(train_split.images[:SAMPLES].clone(), train_split.labels[:SAMPLES].clone(), dtype=torch.float64)


def test_per_sample_norms_make_the_step_of_the_same_samples(tmp_path, data):
    dp = replicated(tmp_path, data, "gn4", w=2, b=2, k=2)["grad"]
    assert rel(dp, looped(data, "gn4", b=2, k=4)) < 1e-10  # accumulation over the same 8 samples
    assert rel(dp, looped(data, "gn4", b=8, k=1)) < 1e-10  # and the big batch of them


def test_per_replica_batchnorm_is_accumulation_not_the_big_batch(tmp_path, data):
    dp = replicated(tmp_path, data, "bn", w=2, b=2, k=2)["grad"]
    assert rel(dp, looped(data, "bn", b=2, k=4)) < 1e-10  # Goyal's footnote: DP (w, b, k) = accumulation (b, w*k)
    assert rel(dp, looped(data, "bn", b=8, k=1)) > 1e-3  # and not one batch of w*b*k


def test_synchronized_batchnorm_is_the_big_batch(tmp_path, data):
    out = replicated(tmp_path, data, "bn_sync", w=2, b=4, k=1)
    dp = out["grad"]
    assert rel(dp, looped(data, "bn", b=8, k=1)) < 1e-10  # statistics over both replicas' 4 samples
    assert rel(dp, looped(data, "bn", b=4, k=2)) > 1e-3  # not accumulation's per-micro-batch statistics
    assert out["warned"] == []  # torch.distributed.nn's all_reduce warned on every replica that it is deprecated


@pytest.mark.parametrize("norm", ["bn", "bn_sync"])
def test_the_batched_engine_under_ddp_computes_the_loops_step(tmp_path, data, norm):
    loop = replicated(tmp_path, data, norm, w=2, b=2, k=2)["grad"]
    assert rel(replicated(tmp_path, data, norm, w=2, b=2, k=2, engine="batched")["grad"], loop) < 1e-10


def test_one_all_reduce_per_optimizer_step(tmp_path, data):
    calls = replicated(tmp_path, data, "gn4", w=2, b=2, k=4, steps=3)["calls"]
    for step in range(3):  # DDP's buckets (a small first one, then rebuilt after step 1): each reduced once a step
        buckets = [bucket for at, bucket in calls if at == step]
        assert buckets and sorted(buckets) == sorted(set(buckets)), calls  # not once per micro-batch


def test_each_replica_takes_its_run_of_k_micro_batches_of_each_step():
    stream = [torch.tensor([i]) for i in range(100)]

    def draws(rank: int) -> list[int]:
        from gaexp.data.batches import Draw
        source = (Draw(t) for t in stream)
        return [d.index.item() for d in itertools.islice(replicas.replica_draws(source, rank, 2, 3), 6)]
    assert draws(0) == [0, 1, 2, 6, 7, 8]  # step 1's micro-batches 0-2, step 2's 6-8
    assert draws(1) == [3, 4, 5, 9, 10, 11]


def test_one_replica_of_synchronized_batchnorm_is_batchnorm(data):
    torch.manual_seed(0)
    sync, plain = make_model("bn_sync"), make_model("bn")
    x = data.inputs(slice(0, 8))
    assert torch.equal(sync(x), plain(x))  # outside a process group: nn.BatchNorm2d's own calls
