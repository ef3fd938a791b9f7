"""Host-to-device copies that do not hold the host back."""

from __future__ import annotations

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
