"""A cell's replicas as processes (regime.replicas = w > 1, gaexp/replicas.py): rank 0's team, the ranks it starts
(`replica_main`), and the ranks a launcher started (`follow`, torchrun or launch=slurm's tasks). Each builds its data
and model as rank 0 does and trains in the process group; only rank 0 records (gaexp/cell.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
from typing import Iterator

import torch

from gaexp import engine, replicas
from gaexp.config import Config
from gaexp.data.dataset import open_dataset
from gaexp.model import build
from gaexp.task.build import make as make_task
from gaexp.train import deterministic_cuda, resolve_device, step_plan, train

log = logging.getLogger("gaexp.app")  # the application's log


@contextlib.contextmanager
def team(c: Config, device: torch.device,
         started: replicas.Replicas | None = None) -> Iterator[replicas.Replicas | None]:
    """For a cell of w > 1 replicas (gaexp/replicas.py): ranks 1..w-1 started (`replica_main`), set up and met,
    this process rank 0 of the process group; on the way out each of them ended, and none left running whatever
    happened. A replica that failed or died is the cell's error, naming its rank. None for one replica.
    `started`: the process group of replicas a launcher started, told to train (`follow`)."""
    w = c.regime.replicas
    if started is not None:
        started.tell(replicas.TRAIN)
        try:
            yield started
        except Exception:
            if (failure := started.named_failure()) is not None:  # rank 0's error a symptom of that replica's
                raise failure from None
            raise
        return
    if w == 1:
        yield None
        return
    store, note = replicas.open_store(w)
    if note is not None:
        log.warning("%s", note)
    with replicas.Team(replica_main, (c, store.port, torch.get_num_threads()), w) as others:
        group = None
        try:
            others.wait_ready(store)
            group = replicas.join(0, w, store, device)
            yield group
            others.finish()
        except BaseException as e:
            if not isinstance(e, replicas.ReplicaError):
                others.check(wait_s=5.0)  # rank 0's error may be a replica's death seen from here: that one's
            raise
        finally:
            if group is not None:
                group.close()


def replica_main(index: int, c: Config, port: int, threads: int) -> None:
    """Rank index + 1 of a cell (`team`), in a process of its own: its data and model built as rank 0's, then
    trained in the process group; it records nothing."""
    import torch.distributed as dist

    rank, w = index + 1, c.regime.replicas
    torch.set_num_threads(threads)
    device = replicas.replica_device(resolve_device(c.device), rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if c.deterministic:
            deterministic_cuda()
    model, train_data, _ = build(c, open_dataset(c.data, progress=False), device)
    store = dist.TCPStore(replicas.HOST, port, w, False, timeout=datetime.timedelta(seconds=replicas.SETUP_TIMEOUT_S))
    store.set(replicas.READY.format(rank), "1")
    group = replicas.join(rank, w, store, device)
    try:
        train(model, train_data, None, c.train, step_plan(c, device, group), make_task(c.task))
    finally:
        group.close()


def follow(c: Config, choice: engine.Choice, group: replicas.Replicas) -> float:
    """Rank 1..w-1 of the replicas a launcher started (torchrun, launch=slurm's tasks): trains beside rank 0 when
    it says so (`team`), its data and model built as rank 0's, and records nothing; rank 0's run is the cell's.
    Its own error is left for rank 0 to name; nan to its launcher either way (submitit reads task 0's result)."""
    if group.hear() != replicas.TRAIN:  # the cell was finished, or rank 0 failed before training
        return float("nan")
    try:
        if group.device.type == "cuda":
            torch.cuda.set_device(group.device)
        model, train_data, _ = build(c, open_dataset(c.data, progress=False), group.device)
        c = dataclasses.replace(c, accumulate=engine.within_split(choice, c.regime.batch_size, c.regime.num_accum,
                                                                  len(train_data), make_task(c.task),
                                                                  c.regime.replicas).engine)  # rank 0's engine
        train(model, train_data, None, c.train, step_plan(c, group.device, group), make_task(c.task))
    except Exception as e:  # noqa: BLE001 - rank 0 names it in the cell's run; a task that raised would stop a sweep
        log.exception("replica %d of %d failed", group.rank, group.world)
        group.failed(e)
    return float("nan")
