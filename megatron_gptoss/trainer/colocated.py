"""What every rank hosts: its learner shard (stage models of the `parallel` layout, the optimizer, the frozen
reference policy when a KL loss or a KL penalty in the reward is on) and its part of the rollout engine,
with the bridge between them.

    stage models   meta device -> tensor / sequence / expert parallel (`parallel.apply.parallelize`)
                   -> materialize -> data parallel; one model per (virtual) pipeline stage of this rank
    weights        `run.init_from_hf` (each rank reads only its slices) or the layout-independent random
                   initialisation; the reference policy starts as a copy (with LoRA, `model.lora`, it is
                   the policy's own models with the adapters disabled, and only the adapters train)
    optimizer      the distributed optimizer (fp32 master weights; sharded over data parallel when
                   `parallel.use_distributed_optimizer`)
    engine         `trainer.engines`: the embedded engine's shards fed by the fan-out, or vLLM on rank 0
                   (RL only: a supervised run has none)
    critic         with `algorithm.advantage: gae`, the value model (`model.value`) in the policy's layout,
                   started from the policy's weights (or `critic.init_from_hf`), with its own distributed
                   optimizer (`critic.*`)

World size 1 is the same code with one rank.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_gptoss.config import TrainConfig
from megatron_gptoss.engine_api.protocol import Generation, SamplingParams
from megatron_gptoss.errors import EngineError
from megatron_gptoss.model.gpt_oss import GPTOSSModel
from megatron_gptoss.model.value import VALUE_HEAD, ValueModel
from megatron_gptoss.parallel.apply import parallelize
from megatron_gptoss.parallel.data_parallel import DistributedOptimizer, apply_data_parallel
from megatron_gptoss.parallel.dims import ParallelDims
from megatron_gptoss.parallel.loading import init_parallel, load_hf_parallel, materialize
from megatron_gptoss.parallel.pipeline import PipelineRunner, build_stage_model, stage_plans
from megatron_gptoss.rl.parallel_learner import ParallelPolicy
from megatron_gptoss.trainer.engines import DTYPES, make_engine_host


class Colocated:
    """The learner and the engine part of this rank. Collective to build (every rank of the default group)."""

    def __init__(self, cfg: TrainConfig, device: torch.device, with_engine: bool = True):
        self.cfg, self.device = cfg, device
        self.dims = dims = ParallelDims.build(cfg.parallel, cfg.model)
        self.plans = stage_plans(dims, cfg.model.num_layers, cfg.parallel.pipeline_layers or None)
        self.models = [self._stage(plan) for plan in self.plans]
        self.with_reference = bool(cfg.ppo.kl_coef or cfg.algorithm.kl_in_reward_coef)
        # With LoRA the reference is the policy's own models with the adapters disabled: no copy.
        copies = self.with_reference and not cfg.model.lora.enabled
        self.reference = [self._stage(plan) for plan in self.plans] if copies else []
        for model in self.reference:
            model.requires_grad_(False)
        gae = cfg.algorithm.advantage == "gae"
        self.critic: list[GPTOSSModel] = [self._stage(plan, value=True) for plan in self.plans] if gae else []
        self.critic_policy: ParallelPolicy | None = None
        self.host = make_engine_host(cfg, self.models, dims, device) if with_engine else None
        self.optimizer: DistributedOptimizer | None = None

    def _stage(self, plan, value: bool = False) -> GPTOSSModel:
        dtype = DTYPES[self.cfg.run.dtype]
        if value:
            model: GPTOSSModel = ValueModel(
                self.cfg.model, dtype, "meta", plan.layers, plan.is_first, plan.is_last
            )
        else:
            model = build_stage_model(self.cfg.model, plan, dtype, "meta")
        parallelize(model, self.dims, self.cfg.parallel)  # modules swapped in place
        materialize(model, self.device)
        apply_data_parallel(model, self.dims)
        return model

    def initialise(self) -> None:
        """Weights from `run.init_from_hf` or the layout-independent random initialisation; the reference
        policy starts as a copy."""
        if self.cfg.run.init_from_hf:
            load_hf_parallel(self.models, self.cfg.run.init_from_hf, self.dims, self.cfg.model)
            if self.cfg.model.lora.enabled:  # the adapters of the HF base
                init_parallel(self.models, self.cfg.model, self.dims, self.cfg.run.seed, adapters_only=True)
        else:
            init_parallel(self.models, self.cfg.model, self.dims, self.cfg.run.seed)
        with torch.no_grad():
            for ref, model in zip(self.reference, self.models):
                for p, q in zip(ref.parameters(), model.parameters()):
                    p.copy_(q)
        init_critic(self.critic, self.models, self.cfg.model.init_std, self.cfg.run.seed)
        if self.critic and self.cfg.critic.init_from_hf:  # the body from its own HF directory
            load_hf_parallel(
                self.critic, self.cfg.critic.init_from_hf, self.dims, self.cfg.model, {VALUE_HEAD}
            )

    def build_optimizer(self) -> None:
        """The distributed optimizer (master weights from the parameters as they are now) and the policies."""
        self.optimizer = DistributedOptimizer(
            self.models,
            self.cfg.optim,
            self.dims,
            self.cfg.run.steps,
            shard=self.cfg.parallel.use_distributed_optimizer,
        )
        micro = self.cfg.ppo.num_micro_batches  # the log-prob passes' micro-batches too
        self.policy = ParallelPolicy(
            PipelineRunner(self.models, self.plans, self.dims), self.dims, self.optimizer, micro_batches=micro
        )
        self.reference_policy: ParallelPolicy | None = None
        if self.reference:
            runner = PipelineRunner(self.reference, self.plans, self.dims)
            self.reference_policy = ParallelPolicy(runner, self.dims, micro_batches=micro)
        elif self.with_reference:  # LoRA: the base under the policy's adapters
            runner = PipelineRunner(self.models, self.plans, self.dims)
            self.reference_policy = ParallelPolicy(runner, self.dims, base_only=True, micro_batches=micro)

        if self.critic:
            critic_optim = dataclasses.replace(
                self.cfg.optim, lr=self.cfg.critic.lr, clip_grad=self.cfg.critic.clip_grad
            )
            self.critic_optimizer = DistributedOptimizer(
                self.critic,
                critic_optim,
                self.dims,
                self.cfg.run.steps,
                shard=self.cfg.parallel.use_distributed_optimizer,
            )
            runner = PipelineRunner(self.critic, self.plans, self.dims)
            self.critic_policy = ParallelPolicy(runner, self.dims, self.critic_optimizer, replays=False)

    def group_optimizers(self) -> dict[str, DistributedOptimizer]:
        """The optimizers of module groups other than the policy's (checkpointed beside it)."""
        return {"critic": self.critic_optimizer} if self.critic else {}

    def modules(self) -> dict[str, list[GPTOSSModel]]:
        return {
            "model": self.models,
            **({"reference": self.reference} if self.reference else {}),
            **({"critic": self.critic} if self.critic else {}),
        }

    def sync(self) -> dict[str, float]:
        """The learner's weights into the engine, if there is one (collective); the sync's metrics."""
        return self.host.sync() if self.host is not None else {}

    def sleep_engine(self) -> dict[str, float]:
        """The engine frees its memory for the learner (`rollout.sleep_level` > 0): the bytes released."""
        level = self.cfg.rollout.sleep_level
        return self.host.sleep(level) if self.host is not None and level else {}

    def engine_stats(self) -> dict[str, float]:
        """The engine's step statistics since the last call (`engine/*`; empty for engines that keep their
        own)."""
        return self.host.step_stats() if self.host is not None else {}

    def wake_engine(self) -> dict[str, float]:
        """The engine takes its weights' memory back, ready for the sync: the bytes re-taken."""
        level = self.cfg.rollout.sleep_level
        return self.host.wake() if self.host is not None and level else {}

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """Every row's generation on every rank (collective)."""
        if self.host is None:
            raise EngineError("this run has no rollout engine (run.mode is not 'rl')")
        return self.host.generate(prompts, params)

    def shutdown(self) -> None:
        if self.host is not None:
            self.host.shutdown()


@torch.no_grad()
def init_critic(critic: list[GPTOSSModel], policy: list[GPTOSSModel], std: float, seed: int) -> None:
    """The critic's stages start as the policy's (same layout: every shared parameter copied shard for
    shard); the value head [1, H], replicated, from Normal(0, std) with a generator seeded by `seed`."""
    for value_model, model in zip(critic, policy):
        source = dict(model.named_parameters())
        for name, p in value_model.named_parameters():
            if name == VALUE_HEAD:
                gen = torch.Generator().manual_seed(seed)
                p.copy_(torch.randn(p.shape, generator=gen).mul_(std))
            else:
                p.copy_(source[name])
