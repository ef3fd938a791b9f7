"""What keeps the host from holding the GPU back: host-to-device copies that do not wait, and Python's garbage
collector kept out of the steps."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterable, Iterator

import torch

# Torch intra-op threads of a process that feeds a GPU, unless OMP_NUM_THREADS or the run says otherwise.
GPU_HOST_THREADS = 1


def set_host_threads(device: torch.device, requested: int = 0) -> int:
    """Set torch's intra-op threads for a process computing on `device`; returns the number set (0: left
    as it was). `requested` > 0 is used as given. Otherwise, on a GPU, `GPU_HOST_THREADS` unless the
    environment sets OMP_NUM_THREADS: such a process's host work inside a step is small index arithmetic
    that queues the GPU's kernels, and a pool of one thread per core turned it into parallel regions whose
    barrier now and then waited about 10 ms for a worker the OS had not scheduled, while the GPU ran dry
    (one H100, 16 cores: 2 layers at gpt-oss-120b width, 20-30 steps: spread 23-48% with 16 threads,
    3.2% with 1; benchmarks/RESULTS.md, "the one-GPU training step's spread"). On the CPU torch's
    default stays (all cores)."""
    if requested > 0:
        threads = requested
    elif device.type == "cuda" and "OMP_NUM_THREADS" not in os.environ:
        threads = GPU_HOST_THREADS
    else:
        return 0
    torch.set_num_threads(threads)
    return threads


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`. From host memory to a GPU it goes through pinned memory in a non-blocking
    copy: a copy from pageable memory makes the host wait until the GPU has run everything queued
    before it. The caching host allocator keeps the pinned block until the copy has run, so the source
    may be changed or freed at once. A source whose elements share memory (an expanded view) is made
    contiguous first: pinning needs one element per location."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.contiguous().pin_memory().to(device, non_blocking=True)


def collect_between_steps(steps: Iterable[int], every: int) -> Iterator[int]:
    """`steps`, with Python's automatic garbage collection off while the caller runs a step and a full
    collection after every `every`-th step (the trainer's `run.gc_every`); `every` 0: the collector as
    Python runs it. The collector is on again once the iteration ends, however it ends."""
    if every <= 0:
        yield from steps
        return
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for step in steps:
            yield step
            if step % every == 0:
                gc.collect()
    finally:
        if enabled:
            gc.enable()
