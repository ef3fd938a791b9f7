"""Watching the batches a run trains, in tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from megatron_gptoss.trainer import loop


@contextmanager
def observed_batches(observe: Callable[[tuple[Any, ...], Any], None]) -> Iterator[None]:
    """While open, every call of `trainer.loop.build_batch` (the learner's batch of a step) also hands its
    arguments (prompt ids, responses, log-probs, rewards, sources, routing, versions) and the batch it built
    to `observe`; the original function is back on exit."""
    build = loop.build_batch

    def observed(*args):
        batch = build(*args)
        observe(args, batch)
        return batch

    loop.build_batch = observed  # type: ignore[assignment]
    try:
        yield
    finally:
        loop.build_batch = build  # type: ignore[assignment]
