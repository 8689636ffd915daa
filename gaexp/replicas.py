"""Data parallelism, the other road to a big batch: a cell of w replicas (regime.replicas, `w2b8a1`) trains as w
processes through torch.distributed (gloo on the CPU, NCCL on CUDA), each with micro-batch b and k accumulation
steps, its model wrapped in DistributedDataParallel (docs/study.md, "Data parallelism").

- **The same step as the loop.** Each replica scales each micro-batch's loss by 1/k and DDP averages the
  replicas' gradients, so a step is the mean over its w*b*k samples. `no_sync` covers the first k-1 micro-batches:
  one gradient all-reduce per optimizer step (`summing_locally`, around gaexp/train.py's `accumulate`).
- **Paired samples.** Replica r takes, of each step's w*k micro-batches of the seed's stream, the r-th run of k
  consecutive ones (`replica_draws`): the DP cell (w, b, k) sees in each step the samples of its accumulation twin
  (b, w*k) and of the true batch (w*b*k, 1).
- **Who records.** The cell's own process is rank 0: it writes the one MLflow run, evaluates, and reports the
  step losses averaged over the replicas. Ranks 1..w-1 are started by PyTorch's `torch.multiprocessing`
  (spawn), train, and write nothing (`Team`).
- **Started by a launcher.** Under `torchrun` (one cell: `torchrun --nproc-per-node 2 -m gaexp regime=w2b8a1`,
  across nodes with its rendezvous, docs/cluster.md) and under launch=slurm (a DP cell's job asks for w tasks,
  their meeting file on the shared file system), the w processes are the launcher's: each joins the process group
  from its environment (`launched`, `join_launched`), rank 0 tells the others whether the cell trains
  (`Replicas.tell`: a finished cell is skipped by all), and a replica that fails leaves its error in the store for
  rank 0 to name.
- **BatchNorm.** Per replica (norm=bn: DDP's BatchNorm normalizes each replica's micro-batch, its running
  statistics the replica's own, `forward_sync_buffers=False`; rank 0's evaluate) or synchronized (norm=bn_sync:
  statistics over every replica's micro-batch, `CrossReplicaBatchNorm2d` in gaexp/layers.py on the CPU, where
  `nn.SyncBatchNorm` refuses to run, and `nn.SyncBatchNorm` on CUDA; its running statistics the same on every
  replica).

Imports no MLflow and no Hydra: gaexp/cell.py runs a cell of w replicas with this module.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gaexp.data.batches import Draw
from gaexp.config import PrecisionConfig
from gaexp import machine
from gaexp.machine import TORCHRUN

log = logging.getLogger("gaexp.app")

BACKENDS = {"cpu": "gloo", "cuda": "nccl"}
HOST = "127.0.0.1"  # the replicas of a cell meet on this machine (a multi-node cluster: docs/cluster.md)
STORE_FILE_ENV = "GAEXP_REPLICAS_STORE"  # launch=slurm: the file a DP cell's tasks meet through (a FileStore)
PORT_ENV = "GAEXP_REPLICAS_PORT"  # a port to meet on, where a firewall wants one; taken when free, else another
SETUP_TIMEOUT_S = 600  # the longest a replica's setup (data, model) may take before rank 0 gives up on it
STEP_TIMEOUT_S = 1800  # the longest one collective may wait for a replica (gloo's default is 30 minutes too)


class ReplicaError(RuntimeError):
    """A replica of a cell failed or died: its rank and why, in one line."""


def replica_draws(batches: Iterator[Draw], rank: int, replicas: int, num_accum: int) -> Iterator[Draw]:
    """This replica's micro-batches: of each step's `replicas * num_accum` micro-batches of the stream, the
    `rank`-th run of `num_accum` consecutive ones (replica 0 the first k, replica 1 the next k, ...)."""
    while True:
        step = [next(batches) for _ in range(replicas * num_accum)]
        yield from step[rank * num_accum:(rank + 1) * num_accum]


def summing_locally(model: nn.Module, last: bool) -> ContextManager:
    """Around a micro-batch's forward and backward: under DDP, all but the step's last micro-batch sum their
    gradients locally (`no_sync`), so the last one's backward all-reduces the step's sum once; anything else as
    it is."""
    if isinstance(model, DistributedDataParallel) and not last:
        return model.no_sync()
    return contextlib.nullcontext()


@dataclass
class Replicas:
    """This process's place among a cell's replicas, once the process group is up (`join`)."""

    rank: int
    world: int
    device: torch.device
    norm_group: Any = None  # the process group synchronized BatchNorm reduces over (its own: never in DDP's way)
    store: Any = None  # where a launcher's replicas hear rank 0's decision and leave their errors (`launched`)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def wrap(self, model: nn.Module) -> DistributedDataParallel:
        """The model under DDP: rank 0's parameters broadcast once, each replica's BatchNorm buffers its own
        (`forward_sync_buffers=False`), synchronized BatchNorm reducing over `norm_group` (`nn.SyncBatchNorm` on
        CUDA)."""
        from gaexp.layers import CrossReplicaBatchNorm2d

        if self.device.type == "cuda":
            model = to_sync_batchnorm(model)
        for layer in model.modules():
            if isinstance(layer, (CrossReplicaBatchNorm2d, nn.SyncBatchNorm)):
                layer.process_group = self.norm_group
        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids, forward_sync_buffers=False)

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """`values` averaged over the replicas (the step losses rank 0 reports)."""
        values = values.clone()
        dist.all_reduce(values)
        return values / self.world

    def tell(self, decision: str) -> None:
        """Rank 0 to the others, before training: TRAIN, or SKIP (the cell is finished, or rank 0 failed first)."""
        self.store.set(DECISION, decision)

    def hear(self) -> str:
        """What rank 0 told (`tell`), waiting for it as long as a replica's setup may take."""
        self.store.wait([DECISION], datetime.timedelta(seconds=SETUP_TIMEOUT_S))
        return self.store.get(DECISION).decode()

    def failed(self, error: BaseException) -> None:
        """This replica's error, one line, left for rank 0 to name (`named_failure`)."""
        lines = [line for line in f"{type(error).__name__}: {error}".splitlines() if line.strip()]
        self.store.set(FAILED.format(self.rank), lines[-1] if lines else type(error).__name__)

    def named_failure(self, wait_s: float = 5.0) -> "ReplicaError | None":
        """On rank 0, after its training raised: the first other replica that left an error (`failed`), waiting
        up to `wait_s` for it, since rank 0's error ('Connection closed by peer') may be a symptom of it."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank in range(1, self.world):
                if self.store.check([FAILED.format(rank)]):
                    why = self.store.get(FAILED.format(rank)).decode()
                    return ReplicaError(f"replica {rank} of {self.world} failed: {why}")
            if time.monotonic() > deadline:
                return None
            time.sleep(0.1)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def to_sync_batchnorm(model: nn.Module) -> nn.Module:
    """On CUDA, each `CrossReplicaBatchNorm2d` as the `nn.SyncBatchNorm` it stands for, its parameters and buffers
    taken over (per-replica BatchNorm stays as it is: `convert_sync_batchnorm` would convert it too)."""
    from gaexp.layers import CrossReplicaBatchNorm2d

    for name, child in list(model.named_children()):
        if isinstance(child, CrossReplicaBatchNorm2d):
            sync = nn.SyncBatchNorm(child.num_features, child.eps, child.momentum, child.affine,
                                    child.track_running_stats)
            sync.load_state_dict(child.state_dict())
            setattr(model, name, sync.to(child.weight.device, child.weight.dtype))
        else:
            to_sync_batchnorm(child)
    return model


# --- meeting: a store on rank 0, the others joining it --------------------------------------------

def open_store(world: int) -> tuple[dist.TCPStore, str | None]:
    """Rank 0's store for `world` replicas, and a one-line note when it could not take the port asked for
    (GAEXP_REPLICAS_PORT, in use): then the system's choice of a free one. Without a port asked, the system's."""
    asked = os.environ.get(PORT_ENV)
    timeout = datetime.timedelta(seconds=SETUP_TIMEOUT_S)
    if asked:
        try:
            return dist.TCPStore(HOST, int(asked), world, True, timeout=timeout, wait_for_workers=False), None
        except dist.DistNetworkError as e:
            if "EADDRINUSE" not in str(e) and "in use" not in str(e):
                raise
            store = dist.TCPStore(HOST, 0, world, True, timeout=timeout, wait_for_workers=False)
            return store, f"{PORT_ENV}={asked} is in use; the replicas meet on port {store.port} instead"
    return dist.TCPStore(HOST, 0, world, True, timeout=timeout, wait_for_workers=False), None


def join(rank: int, world: int, store: dist.TCPStore, device: torch.device) -> Replicas:
    """This process in the cell's process group (gloo on the CPU, NCCL on CUDA), and synchronized BatchNorm's
    own group."""
    device = replica_device(device, rank)
    dist.init_process_group(BACKENDS[device.type], store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=STEP_TIMEOUT_S))
    norm_group = dist.new_group(backend=BACKENDS[device.type])
    return Replicas(rank, world, device, norm_group)


def replica_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: the CPU, or GPU r of this machine's."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", rank % torch.cuda.device_count())


def threads_each(threads: int, replicas: int) -> int:
    """A cell's torch threads shared among its replicas, at least one each (0: torch's default, the cores
    shared the same way)."""
    if threads == 0:
        threads = torch.get_num_threads()
    return max(1, threads // replicas)


def problem(replicas: int, precision: PrecisionConfig, compile: str, device: torch.device) -> str | None:
    """Why a cell of `replicas` cannot run as configured (one line naming what is valid), or None."""
    started = launched()
    if started is not None and (line := launched_problem(started, replicas)) is not None:
        return line
    if replicas == 1:
        return None
    if precision.accumulate_in == "fp32":
        return (f"precision={precision.name} with regime.replicas={replicas}: its float32 buffer sums the "
                "micro-batch gradients outside DDP's all-reduce; valid: precision.accumulate_in=param, or "
                "regime.replicas=1")
    if compile == "all":
        return (f"compile=all with regime.replicas={replicas}: a replica's training runs eager under DDP; valid: "
                "auto, eval, off")
    if device.type == "cuda" and started is None and replicas > torch.cuda.device_count():
        return (f"regime.replicas={replicas}: NCCL needs a GPU per replica and this machine has "
                f"{torch.cuda.device_count()}; valid: an integer in [1, {torch.cuda.device_count()}]")
    if not dist.is_available():
        return f"regime.replicas={replicas}: this torch has no torch.distributed; valid: 1"
    return None


def oversubscribed(replicas: int, cores: int) -> str | None:
    """One line where a cell's replicas are more than this machine's cores: it runs, each replica slower."""
    if replicas <= cores:
        return None
    return (f"regime.replicas={replicas} on {cores} core{'s' if cores != 1 else ''}: the replicas share them, each "
            "slower than on a core of its own")


# --- replicas a launcher started: torchrun's processes, or launch=slurm's tasks ---------------------

DECISION = "gaexp/decision"  # rank 0 to the others: TRAIN or SKIP
FAILED = "gaexp/failed/{}"  # a replica's error, one line, for rank 0 to name
TRAIN, SKIP = "train", "skip"


@dataclass(frozen=True)
class Launched:
    """This process as one of `world` that a launcher started for one cell: torchrun's (RANK, WORLD_SIZE,
    LOCAL_RANK, LOCAL_WORLD_SIZE, its rendezvous's MASTER_ADDR and MASTER_PORT) or launch=slurm's tasks
    (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, and a FileStore at STORE_FILE_ENV on the shared file system)."""

    rank: int
    world: int
    local_rank: int
    local_world: int  # processes of this cell on this node, sharing its cores (SLURM gives each task its own)
    by: str  # torchrun, SLURM
    store_file: str | None = None


def launched(environ: Any = None) -> Launched | None:
    """This process's place among the replicas a launcher started (`Launched`), or None: a cell of w > 1 then
    starts its own (`Team`)."""
    env = os.environ if environ is None else environ
    if env.get(STORE_FILE_ENV) and "SLURM_PROCID" in env:
        return Launched(int(env["SLURM_PROCID"]), int(env.get("SLURM_NTASKS", 1)), int(env.get("SLURM_LOCALID", 0)),
                        1, "SLURM", env[STORE_FILE_ENV])
    if env.get(TORCHRUN):
        return Launched(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                        int(env.get("LOCAL_WORLD_SIZE", 1)), "torchrun")
    return None


def launched_problem(started: Launched, replicas: int) -> str | None:
    """Why a cell of `replicas` cannot run on the processes a launcher started (one line), or None."""
    return machine.launched_problem(started.by, started.world, replicas)


def join_launched(started: Launched, device: torch.device) -> Replicas:
    """This process in its cell's process group, met through its launcher's store: torchrun's rendezvous store
    (the agent's, where it keeps one), or launch=slurm's FileStore; keys of gaexp's own under a prefix."""
    if device.type == "cuda":
        device = torch.device("cuda", started.local_rank % torch.cuda.device_count())
    timeout = datetime.timedelta(seconds=SETUP_TIMEOUT_S)
    if started.store_file is not None:
        store: Any = dist.FileStore(started.store_file, started.world)
    else:
        leader = started.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), started.world, leader,
                              timeout=timeout)
    attempt = f"{os.environ.get(TORCHRUN, '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    store = dist.PrefixStore(f"gaexp/{attempt}", store)  # a restarted torchrun attempt meets afresh
    store.set_timeout(timeout)
    dist.init_process_group(BACKENDS[device.type], store=dist.PrefixStore("group", store), rank=started.rank,
                            world_size=started.world, timeout=datetime.timedelta(seconds=STEP_TIMEOUT_S))
    norm_group = dist.new_group(backend=BACKENDS[device.type])
    return Replicas(started.rank, started.world, device, norm_group, store)


# --- ranks 1..w-1: started by torch.multiprocessing, watched by rank 0 ----------------------------

READY = "gaexp/ready/{}"  # a replica set up (data and model built): a key it writes in the store


@contextlib.contextmanager
def stdlib_start_method() -> Iterator[None]:
    """While starting processes: the global start method one of the standard library's. A spawned child is told
    its parent's global method and sets it, so one started from a joblib (loky) worker, whose method is `loky`,
    died at once ('cannot find context for loky'); the worker's own is restored after."""
    import multiprocessing.context as mpc

    default = mpc._default_context
    if default.get_start_method(allow_none=True) in (None, "fork", "spawn", "forkserver"):  # loky registers its own
        yield
        return
    before = default._actual_context  # noqa: SLF001
    default._actual_context = default.get_context("spawn")  # noqa: SLF001
    try:
        yield
    finally:
        default._actual_context = before  # noqa: SLF001


class Team:
    """Ranks 1..w-1 of a cell, started with `torch.multiprocessing.start_processes` (spawn) running
    `entry(index, *args)` (rank = index + 1); rank 0 is this process. Used as a context manager: on the way out
    every replica still alive is stopped, so none is left behind whatever happened."""

    def __init__(self, entry: Callable[..., None], args: tuple, replicas: int) -> None:
        self.replicas = replicas
        with stdlib_start_method():
            self.context = torch.multiprocessing.start_processes(entry, args=args, nprocs=replicas - 1, join=False,
                                                                 start_method="spawn")

    def wait_ready(self, store: dist.TCPStore, timeout_s: float = SETUP_TIMEOUT_S) -> None:
        """Until every other replica has set up, or one fails (`ReplicaError` naming it)."""
        keys = [READY.format(rank) for rank in range(1, self.replicas)]
        deadline = time.monotonic() + timeout_s
        while not store.check(keys):
            self.check()
            if time.monotonic() > deadline:
                raise ReplicaError(f"replicas {', '.join(map(str, range(1, self.replicas)))} of {self.replicas} not "
                                   f"set up after {timeout_s:.0f} s")
            time.sleep(0.05)

    def _join(self, timeout: float) -> bool:
        """Whether every other replica has ended (well); `ReplicaError` naming the first that failed or died."""
        try:
            return self.context.join(timeout=timeout)
        except torch.multiprocessing.ProcessRaisedException as e:
            last = [line for line in str(e).strip().splitlines() if line.strip()][-1].strip()
            raise ReplicaError(f"replica {e.error_index + 1} of {self.replicas} failed: {last}") from None
        except torch.multiprocessing.ProcessExitedException as e:
            how = f"signal {e.signal_name}" if e.signal_name else f"exit code {e.exit_code}"
            raise ReplicaError(f"replica {e.error_index + 1} of {self.replicas} died ({how})") from None

    def check(self, wait_s: float = 0.0) -> None:
        """Raise `ReplicaError` naming the first replica that failed or died, waiting up to `wait_s` for one to
        end (where rank 0's own error may be a symptom of it)."""
        deadline = time.monotonic() + wait_s
        while not self._join(timeout=0.01) and time.monotonic() < deadline:
            pass

    def finish(self) -> None:
        """Every other replica ended well, or `ReplicaError`."""
        while not self._join(timeout=1.0):
            pass

    def __enter__(self) -> "Team":
        return self

    def __exit__(self, *exc: object) -> None:
        for process in self.context.processes:
            if process.is_alive():
                process.terminate()
        for process in self.context.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
