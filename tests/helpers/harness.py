"""A pool of gloo processes reused across tests: `pool(n).run(fn, *args)` runs the module-level function
`fn(*args)` on every rank of an n-rank world and returns the per-rank results, failing (not hanging)
when a rank raises or the call outlasts its timeout."""

from __future__ import annotations

import atexit
import os
import queue
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_POOLS: dict[int, WorkerPool] = {}


def _worker(rank: int, world: int, init_file: str, tasks, results) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    while True:
        item = tasks.get()
        if item is None:
            break
        fn, args = item
        try:
            results.put((rank, True, fn(*args)))
        except BaseException:  # report every failure to the parent, including assertion errors
            results.put((rank, False, traceback.format_exc()))
        _destroy_subgroups()
    dist.destroy_process_group()


def _destroy_subgroups() -> None:
    """Free the process groups a task built (each gloo group holds threads that poll: left alive across
    hundreds of tests they take a good share of the CPU); the world group stays."""
    for group in list(dist.distributed_c10d._world.pg_map):
        if group is not dist.GroupMember.WORLD:
            dist.destroy_process_group(group)


class WorkerPool:
    def __init__(self, world: int):
        self.world = world
        ctx = mp.get_context("spawn")
        self.init_file = tempfile.mktemp(prefix="gloo_init_")
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(
                target=_worker, args=(r, world, self.init_file, self.tasks[r], self.results), daemon=True
            )
            for r in range(world)
        ]
        for p in self.procs:
            p.start()
        self.broken = False

    def run(self, fn, *args, timeout: float = 300.0) -> list:
        if self.broken:
            raise RuntimeError(f"the {self.world}-rank pool broke in an earlier test")
        for q in self.tasks:
            q.put((fn, args))
        out: list = [None] * self.world
        errors = []
        for _ in range(self.world):
            try:
                rank, ok, value = self.results.get(timeout=timeout)
            except queue.Empty:
                self.close(kill=True)
                raise TimeoutError(
                    f"{fn.__name__} did not finish on all {self.world} ranks in {timeout} s"
                ) from None
            if ok:
                out[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
        if errors:
            raise AssertionError("\n".join(errors))
        return out

    def close(self, kill: bool = False) -> None:
        self.broken = True
        for q, p in zip(self.tasks, self.procs):
            if p.is_alive() and not kill:
                q.put(None)
        for p in self.procs:
            p.join(timeout=5 if not kill else 0.1)
            if p.is_alive():
                p.kill()
        _POOLS.pop(self.world, None)


def pool(world: int) -> WorkerPool:
    """The shared pool of `world` gloo ranks (started on first use, closed at exit)."""
    if world not in _POOLS or _POOLS[world].broken:
        _POOLS[world] = WorkerPool(world)
    return _POOLS[world]


@atexit.register
def _close_all() -> None:
    for p in list(_POOLS.values()):
        p.close()
