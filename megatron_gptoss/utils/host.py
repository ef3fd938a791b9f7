"""What keeps the host from holding the GPU back: host-to-device copies that do not wait, and Python's garbage
collector kept out of the steps."""

from __future__ import annotations

import gc
from collections.abc import Iterable, Iterator

import torch


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
