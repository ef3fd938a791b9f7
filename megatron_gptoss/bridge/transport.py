"""Transport: moving the exporter's buckets to rollout engines. Every receiver ends with the bucket in memory
it owns: never the learner's parameters, never a buffer the sender will overwrite.

    in-process   the engine lives in the exporting (dst) process: `sync_in_process` hands it the
                 exporter's (name, tensor) stream; the tensors are fresh (`bridge.export`)
    CUDA IPC     a colocated engine in another process on the same node: `IpcSender` keeps ONE CUDA buffer
                 (the bucket size, reused for every bucket of every step) whose IPC handle is made once; per
                 bucket it packs (`rollout.buckets`), synchronises and hands (handle, metadata) to `deliver`,
                 which returns when every receiver has copied the bucket out (`receive_ipc`)
    broadcast    receivers in a process group (other nodes' engine hosts, or where CUDA IPC is unavailable):
                 `broadcast_buckets` sends each packed bucket from the exporting rank (gloo on CPUs, NCCL on
                 GPUs); every member gets its own copy

CUDA IPC needs sender and receivers to see the GPUs under the same indices (same CUDA_VISIBLE_DEVICES order).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from megatron_gptoss.rollout.buckets import Meta, pack, packed_size, unpack

Pairs = list[tuple[str, torch.Tensor]]


def sync_in_process(buckets: Iterable[Pairs], engine, is_dst: bool, strict: bool = True) -> None:
    """On the dst rank the engine takes the exported stream; elsewhere the buckets are only drained (the
    export is collective, every learner rank iterates it)."""
    if is_dst:
        engine.update_weights((pair for bucket in buckets for pair in bucket), strict=strict)
    else:
        for _ in buckets:
            pass


# ------------------------------------------------------------------------------------------------
# CUDA IPC
class IpcSender:
    """One reusable CUDA bucket buffer shared by IPC. A bucket larger than the buffer (a single transfer
    above the bucket size) makes it grow, which changes the handle; receivers open whatever handle comes."""

    def __init__(self, bucket_bytes: int, device: torch.device | str):
        self.device = torch.device(device)
        self._allocate(bucket_bytes)

    def _allocate(self, nbytes: int) -> None:
        from torch.multiprocessing.reductions import reduce_tensor

        self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        _, args = reduce_tensor(self.buffer)
        self.handle = pickle.dumps(args)  # bytes: any control channel carries them

    def stage(self, pairs: Pairs) -> list[Meta]:
        """Pack `pairs` into the shared buffer; returns their metadata once the copies have completed."""
        if packed_size(pairs) > self.buffer.numel():
            self._allocate(packed_size(pairs))
        _, metas = pack(pairs, out=self.buffer)
        torch.cuda.current_stream(self.device).synchronize()
        return metas

    def send(self, buckets: Iterable[Pairs], deliver: Callable[[bytes, list[Meta]], object]) -> int:
        """Stage every bucket and `deliver(handle, metas)` it; `deliver` must return only after every receiver
        has copied the bucket (the next bucket overwrites the buffer). Returns the bytes sent."""
        sent = 0
        for pairs in buckets:
            if pairs:
                metas = self.stage(pairs)
                deliver(self.handle, metas)
                sent += packed_size(pairs)
        return sent


def receive_ipc(handle: bytes, metas: list[Meta]) -> Pairs:
    """(Receiver) the bucket behind an `IpcSender` handle, copied into this process's own memory."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    shared = rebuild_cuda_tensor(*pickle.loads(handle))
    used = max((offset + _nbytes(dtype, shape) for _, dtype, shape, offset in metas), default=0)
    owned = shared[:used].clone()
    torch.cuda.current_stream(owned.device).synchronize()
    return unpack(owned, metas)


# ------------------------------------------------------------------------------------------------
# Broadcast
def broadcast_buckets(
    buckets: Iterable[Pairs] | None, src: int, group: dist.ProcessGroup, device: torch.device | str
) -> Iterator[Pairs]:
    """Collective over `group`: each bucket of the `src` rank, broadcast; every member, src included, yields
    it as (name, tensor) pairs in a buffer of its own on `device`.

    Learner ranks pass their exporter's buckets (src: the dst of the export; the others' are empty), so
    the collective export advances in step with the broadcasts; a member outside the learner passes None
    and receives until src signals the end."""
    device = torch.device(device)
    source = None if buckets is None else iter(buckets)
    is_src = dist.get_rank() == src
    while True:
        pairs = None if source is None else next(source, None)  # advances the export on learner ranks
        header: list = [None, 0]
        if is_src and pairs is not None:
            buffer, metas = pack([(n, t.to(device)) for n, t in pairs]) if pairs else (_empty(device), [])
            header = [metas, buffer.numel()]
        dist.broadcast_object_list(header, src=src, group=group, device=device)
        metas, size = header
        if metas is None:
            return
        if not is_src:
            buffer = torch.empty(size, dtype=torch.uint8, device=device)
        dist.broadcast(buffer, src=src, group=group)
        yield unpack(buffer, metas)


def _empty(device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device)


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return int(torch.Size(shape).numel()) * torch.empty((), dtype=getattr(torch, dtype)).element_size()
