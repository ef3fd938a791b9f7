"""The process group every run trains in. Under torchrun (RANK / WORLD_SIZE in the environment) it joins the
launcher's world; started as a plain process it is a world of one rank over an in-memory store, so no port
is bound and two runs can share a machine. A group that already exists (a test's process pool) is used as
it is and left alone afterwards.

    with session(cfg.run) as run_session:   # .device: cuda:LOCAL_RANK on GPUs (NCCL), else the CPU (gloo)
        ...                                 # .beat(step): the watchdog's heartbeat of the main loop

Collectives time out after `run.collective_timeout_s`. Where this process made a group of several ranks, a
watchdog (`parallel.watchdog`) ends every surviving rank with one line naming a rank that stopped beating
for `run.watchdog_stall_s` seconds (a SIGSTOPped or lost rank), instead of waiting out the timeout.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_gptoss.config import RunConfig, TrainConfig
from megatron_gptoss.config.memory import check_fits
from megatron_gptoss.errors import ConfigError
from megatron_gptoss.parallel.watchdog import Watchdog, collective_timeout, default_store
from megatron_gptoss.utils.host import set_host_threads


@dataclass
class Session:
    """This rank's device and the watchdog of its process group (None where none runs)."""

    device: torch.device
    watchdog: Watchdog | None = None

    def beat(self, step: int) -> None:
        """Tell the watchdog the main loop reached `step`."""
        if self.watchdog is not None:
            self.watchdog.beat(step)


def device_of_rank() -> torch.device:
    """This rank's device: the GPU of its LOCAL_RANK where CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def limit_device_memory(device: torch.device, gib: float) -> None:
    """Cap this process's allocations on `device` at `gib` GiB (0: no cap). Raises ConfigError when the
    device holds less."""
    if not gib:
        return
    total = torch.cuda.get_device_properties(device).total_memory
    if gib * 2**30 > total:
        raise ConfigError(f"run.device_memory_gib={gib} exceeds the device's {total / 2**30:.1f} GiB")
    torch.cuda.set_per_process_memory_fraction(gib * 2**30 / total, device)


@contextmanager
def session(run: RunConfig) -> Iterator[Session]:
    """Join or create the default process group for the duration of a run."""
    device = device_of_rank()
    set_host_threads(device, run.num_threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        limit_device_memory(device, run.device_memory_gib)
    if dist.is_initialized():
        yield Session(device)
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = collective_timeout(run.collective_timeout_s)
    if "WORLD_SIZE" in os.environ:  # torchrun / srun: the launcher's rendezvous
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    watchdog = None
    if run.watchdog_stall_s and dist.get_world_size() > 1:
        watchdog = Watchdog(
            default_store(),
            dist.get_rank(),
            dist.get_world_size(),
            stall_s=run.watchdog_stall_s,
            interval_s=run.watchdog_interval_s,
            step_stall_s=run.watchdog_step_stall_s or None,
        ).start()
    try:
        yield Session(device, watchdog)
    except BaseException:
        # a rank that fails is noticed by the others' watchdogs: its group stays for them to see go; a
        # process of its own (world 1) ends its group, so a caller that handles the error can run again
        if dist.get_world_size() == 1:
            dist.destroy_process_group()
        raise
    if watchdog is not None:
        watchdog.close()
    dist.destroy_process_group()


def memory_capacity(device: torch.device, limit_gib: float = 0.0) -> tuple[float, str]:
    """(bytes, what they are) that this rank may use: its GPU's memory (`limit_gib` GiB where that is set,
    run.device_memory_gib), or on the CPU the host's memory (the smaller of the physical memory and the
    cgroup's limit) shared by the ranks of this host (LOCAL_WORLD_SIZE)."""
    if device.type == "cuda" and limit_gib:
        return limit_gib * 2**30, f"run.device_memory_gib of {device}"
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory), f"the memory of {device}"
    total = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    where = "the host memory"
    limit = Path("/sys/fs/cgroup/memory.max")
    text = limit.read_text().strip() if limit.is_file() else "max"
    if text.isdigit() and int(text) < total:
        total, where = float(text), "the memory limit of this process's cgroup"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if local > 1:
        return total / local, f"{where} shared by {local} ranks on this host"
    return total, where


def check_memory(cfg: TrainConfig, device: torch.device) -> None:
    """ConfigError on every rank, with the estimate, when any rank's lower bound of the run's memory
    (`config.memory.run_memory`) exceeds what it may use (`memory_capacity`); collective."""
    capacity, where = memory_capacity(device, cfg.run.device_memory_gib)
    problem = None
    try:
        check_fits(cfg, dist.get_world_size(), capacity, f"{where} of rank {dist.get_rank()}")
    except ConfigError as err:
        problem = str(err)
    problems = [problem]
    if dist.get_world_size() > 1:
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
    first = next((p for p in problems if p), None)
    if first is not None:
        raise ConfigError(first)


def from_rank0(value: Any) -> Any:
    """Rank 0's `value` on every rank of the default group (collective; other ranks pass anything)."""
    box = [value]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]
