"""Agentic rollouts in the trainer (`agent.enabled`): every row of a step is a multi-turn trajectory of the
`agent.AgentLoop`, with the tools of `agent.builtin_tools` and `agent.tools`. Collective, like the engine
hosts: every rank returns every row's trajectory.

    per replica   the embedded engine with one rank per replica (rollout tensor and expert parallel 1) and
                  `agent.sessions`:
                  replica r runs the loop on its block of rows with engine sessions (each trajectory keeps
                  its KV cache across turns) and its own tool executor; the trajectories are gathered
    lockstep      any other engine layout, and vLLM: every rank runs the same loop over all rows, each turn
                  through the host's collective `generate` (vLLM's prefix caching serves the repeated
                  prefix); rank 0 runs the tools and broadcasts which calls answered and what they said
                  (`agent.lockstep.LockstepExecutor`), so every rank takes the same decisions

Either way, row i samples from the seed stream `params.seed + i` in its first turn, and the rows' results
do not depend on the number of replicas. The python tool's sandbox launcher is started by `start_tools`,
before CUDA is initialised.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from megatron_gptoss.agent import AgentLoop, ToolExecutor, ToolMetrics, ToolRegistry, start_launcher
from megatron_gptoss.agent.lockstep import LockstepExecutor
from megatron_gptoss.agent.loop import AgentGeneration
from megatron_gptoss.agent.sandbox import SandboxLauncher
from megatron_gptoss.config import TrainConfig
from megatron_gptoss.engine_api.protocol import SamplingParams
from megatron_gptoss.errors import ToolError
from megatron_gptoss.trainer.engines import EmbeddedHost


def start_tools(cfg: TrainConfig) -> SandboxLauncher | None:
    """The sandbox launcher when the rollouts offer the python tool (None otherwise), started now: call it
    before CUDA is initialised. Raises ToolError naming every isolation layer this machine lacks, or the
    protections a Landlock ABI below the minimum lacks (unless `sandbox.allow_weak_kernel`), before any
    step runs."""
    if not (cfg.agent.enabled and "python" in cfg.agent.builtin_tools):
        return None
    launcher = start_launcher(cfg.sandbox.uid_base)
    missing = launcher.missing_layers()
    if missing:
        raise ToolError(
            "refusing to run the python tool: sandbox layers missing on this machine: "
            + "; ".join(f"{name}: {why}" for name, why in missing.items())
        )
    launcher.check(cfg.sandbox)
    return launcher


class AgentRollout:
    """`generate(prompts, params)` -> one `AgentGeneration` per prompt on every rank (collective), over the
    colocated setup's engine host; `tool_metrics()` the tool calls since the last call, over all ranks."""

    def __init__(self, cfg: TrainConfig, setup, launcher: SandboxLauncher | None):
        self.cfg, self.setup = cfg, setup
        registry = ToolRegistry.from_config(cfg.agent, cfg.sandbox, launcher)
        host = setup.host
        self.per_replica = (
            cfg.agent.sessions
            and isinstance(host, EmbeddedHost)
            and host.engine_dims.tp * host.engine_dims.ep == 1
        )
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        if self.per_replica or self.world == 1:
            self.executor: ToolExecutor | LockstepExecutor = ToolExecutor.from_config(registry, cfg.agent)
        else:
            rank0 = dist.get_rank() == 0
            self.executor = LockstepExecutor(ToolExecutor.from_config(registry, cfg.agent) if rank0 else None)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[AgentGeneration]:
        agent = self.cfg.agent
        if self.per_replica:
            host = self.setup.host

            def replica(rows: list[list[int]], p: SamplingParams) -> list[AgentGeneration]:
                loop = AgentLoop(host.engine, self.executor, p, agent, use_sessions=True)
                return [t.generation() for t in loop.rollout(rows)]

            return host.by_replica(prompts, params, replica)
        loop = AgentLoop(self.setup, self.executor, params, agent, use_sessions=False)
        return [t.generation() for t in loop.rollout(prompts)]

    def tool_metrics(self) -> dict[str, float]:
        """`ToolMetrics.summary()` of the calls since the last call, summed over every rank's executor
        (collective)."""
        mine = self.executor.metrics()
        parts: list = [mine]
        if self.world > 1:
            parts = [None] * self.world
            dist.all_gather_object(parts, mine)
        total = ToolMetrics()
        for part in parts:
            for f in dataclasses.fields(ToolMetrics):
                if f.name == "latencies":
                    total.latencies += part.latencies
                elif f.name == "peak_running":
                    total.peak_running = max(total.peak_running, part.peak_running)
                else:
                    setattr(total, f.name, getattr(total, f.name) + getattr(part, f.name))
        return total.summary()
