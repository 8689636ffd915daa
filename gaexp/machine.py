"""The machine a run runs on: the CPUs this process may use (affinity mask, cgroup quota, SLURM's grant) and
the device `auto` means here. It imports nothing of gaexp; the schema's resolvers (gaexp/config/resolvers.py) call it."""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path
from typing import Optional

TORCHRUN = "TORCHELASTIC_RUN_ID"  # set by torchrun's agent in every process it starts (gaexp/replicas.py)
CGROUP = Path("/sys/fs/cgroup")  # where a container's CPU quota is read (cgroup v2, else v1's cpu/ controller)


def torchrun_rank() -> Optional[int]:
    """This process's rank among those torchrun started (its RANK), or None outside torchrun."""
    return int(os.environ.get("RANK", "0")) if os.environ.get(TORCHRUN) else None


def launched_problem(by: str, world: int, replicas: int) -> Optional[str]:
    """Why a cell of `replicas` cannot run on the `world` processes a launcher (torchrun, SLURM) started, each a
    replica (one line naming what is valid), or None."""
    if world == replicas:
        return None
    how = "--nproc-per-node times --nnodes" if by == "torchrun" else "the job's tasks"
    return (f"regime.replicas={replicas} on the {world} processes {by} started ({how}): each process is a replica; "
            f"valid: a regime of {world} replicas (w{world}bBaK), or {replicas} process{'es' if replicas > 1 else ''}")


def cgroup_cpus(root: Optional[Path] = None) -> Optional[int]:
    """CPUs a cgroup quota grants this process (v2 `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`),
    rounded up; None without a quota. A container limited to 2 CPUs on a 64-core host sees 64 in its
    affinity mask and only this says 2."""
    root = root or CGROUP
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]  # v2: "max 100000", or "200000 100000"
    except (OSError, ValueError):
        try:  # v1: a quota of -1 means none
            quota = (root / "cpu" / "cpu.cfs_quota_us").read_text()
            period = (root / "cpu" / "cpu.cfs_period_us").read_text()
        except OSError:
            return None
    try:
        quota_us, period_us = int(quota), int(period)
    except ValueError:  # "max": no quota
        return None
    return math.ceil(quota_us / period_us) if quota_us > 0 and period_us > 0 else None


def usable_cores() -> int:
    """CPUs this process may run on: its affinity mask (what taskset, or SLURM's task/affinity and cgroup
    plugins, grant), at most its container's CPU quota (`cgroup_cpus`), and in a SLURM task at most its
    SLURM_CPUS_PER_TASK (clusters that do not bind CPUs)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    limits = [cores, cgroup_cpus() or cores]
    granted = os.environ.get("SLURM_CPUS_PER_TASK", "")
    if granted.isdigit() and int(granted) > 0:
        limits.append(int(granted))
    return max(1, min(limits))


def device_type(device: str) -> str:
    """`${gaexp.device_type:${device}}`: what `device` means where the run runs (auto: cuda when torch sees one)."""
    if device != "auto":
        return device
    import torch  # only when a config is resolved for a run: the schema itself never needs torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def threads_for(setting: int | str, cells: int | None, cores: int | None = None) -> int:
    """torch threads per run: `auto` makes cells x threads = cores (0 keeps torch's default)."""
    if setting != "auto":
        return int(setting)
    if not cells:
        return 0  # one cell at a time: torch's default uses every core
    cores = cores or usable_cores()
    jobs = cells if cells > 0 else max(1, cores + 1 + cells)  # joblib: -1 = all cores, -2 = all but one
    return max(1, cores // jobs)


@functools.cache  # read once per process, not once per cell
def cpu_kind(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """This CPU's model and the instruction set torch's CPU kernels use here ("AMD EPYC (AVX512)"): runs on the
    same kind with the same threads repeat bit for bit; on another kind, within rounding (docs/study.md)."""
    import platform

    import torch

    lines = cpuinfo.read_text(errors="replace").splitlines() if cpuinfo.is_file() else []  # none on macOS
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), None)
    model = model or platform.processor() or platform.machine() or "unknown CPU"
    return f"{model} ({torch.backends.cpu.get_cpu_capability()})"
