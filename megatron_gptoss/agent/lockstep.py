"""`LockstepExecutor`: the tool calls of an agent loop that every rank of a process group runs in lockstep.

When several ranks run the same `AgentLoop` (every rank holds every trajectory and the engine's `generate`
is collective), they must take the same decisions: which calls have answered, and what each answer says.
One rank (`src`) runs the calls on its `ToolExecutor`; at every poll it decides which of the pending calls
are done and broadcasts their outcomes (or the ToolError of a sandbox that cannot run) to the group; the
other ranks resolve placeholder futures with them. A tool therefore runs once per group, and a slow call
delays only what the src rank's own poll would.

    src rank                                 every other rank
    submit(call) -> ToolExecutor.submit      submit(call) -> an unresolved placeholder
    done(futures, wait) ─ broadcast [(index, outcome | error)] ─> resolve those placeholders
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch.distributed as dist

from megatron_gptoss.agent.calls import ToolCall
from megatron_gptoss.agent.executor import ToolExecutor, ToolMetrics
from megatron_gptoss.errors import ToolError


class LockstepExecutor:
    """The `ToolExecutor` interface the agent loop uses (`submit`, `done`, `metrics`), collective over
    `group` (None: the default group). `executor` is used on the group's rank `src` only."""

    def __init__(self, executor: ToolExecutor | None, group: Any = None, src: int = 0):
        self.group, self.src = group, src
        self.is_src = dist.get_rank(group) == src
        if self.is_src and executor is None:
            raise ValueError("the src rank of a LockstepExecutor needs a ToolExecutor")
        self.executor = executor if self.is_src else None

    def submit(self, call: ToolCall, *, budget_left: bool = True) -> Future:
        if self.executor is not None:
            return self.executor.submit(call, budget_left=budget_left)
        return Future()

    def done(self, futures: Sequence[Future], *, wait: bool, wait_all: bool = False) -> list[Future]:
        """The futures done on the src rank, the same on every rank (collective). A call that raised
        raises on every rank: ToolError as itself, anything else as a RuntimeError naming it."""
        message: list[Any] = [None]
        if self.executor is not None:
            index = {id(f): i for i, f in enumerate(futures)}
            answers = []
            for future in self.executor.done(futures, wait=wait, wait_all=wait_all):
                err = future.exception()
                if err is None:
                    answers.append((index[id(future)], "ok", future.result()))
                else:
                    kind = "tool_error" if isinstance(err, ToolError) else "error"
                    answers.append((index[id(future)], kind, f"{type(err).__name__}: {err}"))
            message = [answers]
        src = self.src if self.group is None else dist.get_global_rank(self.group, self.src)
        dist.broadcast_object_list(message, src=src, group=self.group)
        out = []
        for i, kind, payload in message[0]:
            future = futures[i]
            if self.executor is None:  # the src rank's futures hold their outcome already
                if kind == "ok":
                    future.set_result(payload)
                elif kind == "tool_error":
                    future.set_exception(ToolError(payload))
                else:
                    future.set_exception(RuntimeError(payload))
            out.append(future)
        return out

    def metrics(self, reset: bool = True) -> ToolMetrics:
        """The src rank's metrics (empty elsewhere)."""
        return self.executor.metrics(reset) if self.executor is not None else ToolMetrics()
