"""Agentic rollouts in the trainer (`agent.enabled`): every row of a step is a multi-turn trajectory of the
`agent.AgentLoop`, with the tools of `agent.builtin_tools` and `agent.tools`. Collective, like the engine
hosts: every rank returns every row's trajectory.

    per replica   the embedded engine with one rank per replica (rollout tensor and expert parallel 1) and
                  `agent.sessions`:
                  replica r runs the loop on its block of rows with engine sessions (each trajectory keeps
                  its KV cache across turns) and its own tool executor; the trajectories are gathered
    lockstep      any other engine layout, vLLM, and the engine ranks of the separate placement: every
                  (learner) rank runs the same loop over all rows, each turn through the host's collective
                  `generate` (vLLM's prefix caching serves the repeated prefix); rank 0 runs the tools
                  and broadcasts which calls answered and what they said
                  (`agent.lockstep.LockstepExecutor`), so every rank takes the same decisions

Either way, row i samples from the seed stream `params.seed + i` in its first turn, and the rows' results
do not depend on the number of replicas.

Partial rollouts (`rollout.partial`, per replica only): `start` / `advance` / `finish` run a batch's
trajectories in parts (`agent.loop.SessionRun`) for the rollout buffer: ahead of the learner every trajectory
samples its turn and submits its tool call; the calls run while the learner updates; after the weight sync
each trajectory goes on from its tool's answer under the new weights (`rollout.partial_kv`: its session's
cache kept, or computed again), every model token recording the version that sampled it.

The python tool's sandbox launcher is started by `start_tools`, before CUDA is initialised.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from megatron_gptoss.agent import AgentLoop, ToolExecutor, ToolMetrics, ToolRegistry, start_launcher
from megatron_gptoss.agent.lockstep import LockstepExecutor
from megatron_gptoss.agent.loop import AgentGeneration, SessionRun
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
    colocated setup's engine host; `tool_metrics()` the tool calls since the last call, over all ranks; the
    partial-rollout calls of an engine host (`start`, `advance`, `finish`, `weights_changed`) for the rollout
    buffer."""

    decodes_ahead = False  # trajectories advance only in `advance` / `finish`

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
        self.version: int | None = None  # the engine's policy version as `weights_changed` last said
        self.runs: list[SessionRun] = []  # this replica's batches started and not finished

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

    # ------------------------------------------------------------------------- partial rollouts
    def start(self, prompts: list[list[int]], params: SamplingParams) -> tuple[SessionRun | None, int]:
        """This replica's block of the rows as a `SessionRun`, nothing stepped (its sessions open at the
        first `advance` or `finish`); a handle for them."""
        host = self.setup.host
        if not self.per_replica:
            raise ValueError("partial agentic rollouts need agent.sessions and one engine rank per replica")
        rows, params, wanted = host._split(prompts, params)
        if not rows:
            return None, wanted
        run = AgentLoop(host.engine, self.executor, params, self.cfg.agent, use_sessions=True).begin(
            rows, self.version
        )
        self.runs.append(run)
        return run, wanted

    def advance(self, handle: tuple[SessionRun | None, int]) -> None:
        """Every trajectory of `handle` samples until it ends or waits on a tool call (this replica's; no
        collective)."""
        if handle[0] is not None:
            handle[0].advance()

    def finish(self, handle: tuple[SessionRun | None, int]) -> list[AgentGeneration]:
        """The trajectories of `handle` to their end; every replica's, on every rank in row order
        (collective)."""
        run, wanted = handle
        mine: list[AgentGeneration] = []
        if run is not None:
            self.runs.remove(run)
            mine = [t.generation() for t in run.finish()]
        return self.setup.host._gather(mine, wanted)

    def weights_changed(self, version: int, recompute: bool) -> None:
        """The engine holds `version`: the turns sampled from now on record it; with `recompute` a
        trajectory waiting on a tool computes its prefix again when it goes on."""
        self.setup.host.weights_changed(version, recompute)
        self.version = version
        for run in self.runs:
            run.weights_changed(version, recompute)

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
