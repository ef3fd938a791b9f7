"""The training loop, one program for every world size (a plain process is a world of one rank) and both
modes. Every step is collective over the world; every rank holds the whole batch.

    RL step (`run.mode: rl`)
      prompts    the same on every rank, drawn from a generator seeded by (env.seed, step)
      generate   the rollout engine (`trainer.engines`; with `rollout.placement: separate` on engine ranks of
                 their own, the other ranks running this loop as their world: `trainer.separate`); row i
                 sampled from the stream (run.seed, step, i);
                 with `rollout.max_staleness: k` the batches of the next k steps are sampled ahead, and
                 with `rollout.partial` rows in flight continue under each new policy
                 (`trainer.rollout_buffer`)
      score      the task's reward (plus DAPO's overlong penalty); DAPO's dynamic sampling drops groups of
                 equal rewards and generates more (`trainer.rollouts`); a group with a non-finite reward is
                 dropped (`rl.guards`)
      prepare    old (and reference) log-probs through the learner's layout, advantages, rollout
                 correction, engine/learner mismatch metrics (`rl.parallel_learner.prepare`); the old
                 log-probs are the proximal policy of decoupled PPO, the engine's the behaviour policy's
                 (staleness/*, and mismatch and correction by staleness)
      update     PPO epochs and mini-batches, the distributed optimizer (`rl.parallel_learner.update`); the
                 critic's value loss on the same mini-batches when gae (`rl.critic`)
      sync       the learner's weights into the engine through the bridge
    SFT step (`run.mode: sft`): the task's prompts with their reference responses, harmony conversations
      or synthetic documents (`sft.data`), one supervised optimizer step
      (`rl.parallel_learner.supervised_step`)
    cadence (`trainer.cadence`, the same for both): divergence guards, evaluation, metrics log (rank 0:
      metrics.jsonl, TensorBoard, plots), checkpoints, a graceful stop, the final HF export

Prompts, documents, shuffles and sampling depend only on the step, so `resume=auto` continues exactly.
"""

from __future__ import annotations

import random
import time

import torch
import torch.distributed as dist

from megatron_gptoss.agent import agent_metrics
from megatron_gptoss.config import TrainConfig
from megatron_gptoss.data.conversations import ConversationSet
from megatron_gptoss.envs import make_task
from megatron_gptoss.envs.synthetic import progression_documents
from megatron_gptoss.errors import ConfigError
from megatron_gptoss.harmony import VOCAB_SIZE
from megatron_gptoss.hf.io import check_hf_config
from megatron_gptoss.model.sampled_softmax import VocabSample, draw_vocab_sample
from megatron_gptoss.ops import batch_invariant
from megatron_gptoss.rl import parallel_learner
from megatron_gptoss.rl.batch import RolloutBatch, build_batch
from megatron_gptoss.rl.correction import staleness_metrics
from megatron_gptoss.rl.critic import critic_update
from megatron_gptoss.rl.guards import drop_nonfinite_groups
from megatron_gptoss.rl.kl_control import KLController
from megatron_gptoss.trainer.agentic import AgentRollout, start_tools
from megatron_gptoss.trainer.cadence import Cadence, RunResult, claim_output_dir
from megatron_gptoss.trainer.colocated import Colocated
from megatron_gptoss.trainer.common import evaluate, rollout_metrics, sampling_params
from megatron_gptoss.trainer.engines import EmbeddedHost
from megatron_gptoss.trainer.rollout_buffer import RolloutBuffer, idle_fractions
from megatron_gptoss.trainer.separate import EngineClient, Placement, run_separate
from megatron_gptoss.trainer.session import Session, check_memory, session


def run(cfg: TrainConfig) -> RunResult:
    """Train (collective over the default process group, or a world of one made here); returns the last
    evaluation's metrics (RL) or the last step's (SFT) on every rank, with the run's `status` ("finished"
    or "stopped") and last `step`. With rollout.bitwise_on_policy the batch-invariant kernels run for the
    whole run, in the learner and the colocated engine alike."""
    with batch_invariant.enabled(cfg.rollout.bitwise_on_policy):
        return _run(cfg)


def _run(cfg: TrainConfig) -> RunResult:
    launcher = start_tools(cfg)  # the python tool's sandbox launcher, before CUDA
    with session(cfg.run) as run_session:
        if cfg.rollout.placement == "separate":  # engine ranks serve, learner ranks train among themselves
            return run_separate(
                cfg, run_session, lambda placement: _train(cfg, run_session, launcher, placement)
            )
        return _train(cfg, run_session, launcher)


def _train(cfg: TrainConfig, run_session: Session, launcher, placement: Placement | None = None) -> RunResult:
    """The run on this rank's world (every rank, or under `placement` the learner ranks, whose engines are
    the engine ranks')."""
    device = run_session.device
    check_memory(cfg, device)  # sizes that cannot fit fail here, before anything is allocated
    agent = cfg.agent if cfg.agent.enabled else None
    task, tokenizer = make_task(cfg.env, cfg.data, cfg.reward, agent)
    if cfg.model.vocab_size < tokenizer.vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} < the tokenizer's {tokenizer.vocab_size}")
    for hf_dir in (cfg.run.init_from_hf, cfg.critic.init_from_hf):
        if hf_dir:
            check_hf_config(hf_dir, cfg.model)
    conversations = None
    if cfg.run.mode == "sft" and cfg.sft.data == "conversations":
        if cfg.model.vocab_size < VOCAB_SIZE:
            raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} < o200k_harmony's {VOCAB_SIZE}")
        sft = cfg.sft
        conversations = ConversationSet(sft.train_files, cfg.run.seed, sft.reasoning_effort, sft.max_tokens)
    with claim_output_dir(cfg) as claim:
        setup = Colocated(cfg, device, with_engine=cfg.run.mode == "rl" and placement is None)
        if placement is not None:
            setup.host = EngineClient(cfg, setup.models, setup.dims, device, placement)
        rollout = AgentRollout(cfg, setup, launcher) if agent and cfg.run.mode == "rl" else setup
        sampling = sampling_params(cfg, task.stop_token_ids)
        buffer = None
        if cfg.run.mode == "rl":  # the task's prompt stream is saved as the buffer knows it
            host = setup.host if isinstance(setup.host, (EmbeddedHost, EngineClient)) else None
            buffer = RolloutBuffer(cfg, rollout, host, task, sampling)
        with Cadence(cfg, setup, run_session, claim, buffer or task) as cadence:
            evaluation = None
            if cfg.run.mode == "rl":

                def evaluation() -> dict[str, float]:
                    metrics = evaluate(rollout, task, sampling)
                    setup.engine_stats()  # the next step's engine/* count its own rollouts, not these
                    return metrics

            last: dict[str, float] = {}
            always = trained_tokens(conversations) if cfg.sft.sampled_vocab else None
            for step in cadence.steps(evaluation):
                start = time.perf_counter()
                if buffer is not None:
                    last = rl_step(cfg, setup, rollout, buffer, step, device, cadence.kl_ctrl)
                else:
                    batch = supervised_batch(cfg, task, conversations, step, setup.dims.dp)
                    sample = None if always is None else step_vocab_sample(cfg, batch, always, step)
                    last = parallel_learner.supervised_step(
                        setup.policy, batch, cfg.sft.micro_batches, sample
                    )
                last["time/step_s"] = time.perf_counter() - start
                cadence.end_step(step, last)
            return cadence.finish(last)


def rl_step(
    cfg: TrainConfig,
    setup: Colocated,
    rollout: Colocated | AgentRollout,
    buffer: RolloutBuffer,
    step: int,
    device,
    kl_ctrl: KLController,
) -> dict[str, float]:
    """generate -> score -> prepare -> update -> sync; the step's metrics. `rollout`: the setup itself, or
    its agentic rollouts (tool tokens out of the loss); `buffer` gives the step's scored rollouts.
    `kl_ctrl`: the coefficient of the KL penalty in the reward, updated with the step's KL."""
    t0 = time.perf_counter()
    group = cfg.rollout.n_samples_per_prompt
    rollouts, versions, rollout_extra = buffer.take(step, cfg.run.steps)
    generations = rollouts.generations
    agentic = isinstance(rollout, AgentRollout)
    batch = build_batch(
        rollouts.prompt_ids,
        [g.token_ids for g in generations],
        [g.logprobs for g in generations],
        rollouts.rewards,
        [g.sources for g in generations] if agentic else None,  # type: ignore[attr-defined]
        [g.routing for g in generations] if cfg.moe.router_replay == "r3" else None,
        versions,
    )
    batch, kept = drop_nonfinite_groups(batch, group)  # a NaN / inf reward drops its group, counted
    if kept.all_dropped:  # nothing to learn from: the step is skipped (and counted by the guards)
        buffer.wait()
        return {"train/skipped": 1.0, **rollout_extra, **kept.metrics()}
    memory = setup.sleep_engine()  # rollout.sleep_level: the engine's memory for the learner until the sync
    memory.update(setup.engine_stats())  # engine/* and time/engine_*: where the generation's time went
    loss_mask = batch.loss_mask  # before the rollout correction masks any token
    t1 = time.perf_counter()
    batch, metrics = parallel_learner.prepare(
        setup.policy,
        batch,
        cfg.ppo,
        cfg.rollout.temperature,
        group,
        setup.reference_policy,
        cfg.algorithm,
        kl_ctrl.value,
        setup.critic_policy,
        cfg.moe,
    )
    if "kl_reward/kl" in metrics:
        kl_ctrl.update(metrics["kl_reward/kl"], len(batch))
    assert batch.versions is not None and batch.old_logprobs is not None and batch.is_weights is not None
    metrics.update(
        staleness_metrics(
            batch.versions,
            step - 1,  # the learner's version: its optimizer steps so far
            batch.old_logprobs,
            batch.rollout_logprobs,
            loss_mask,
            batch.loss_mask,
            batch.is_weights,
        )
    )
    t2 = time.perf_counter()
    shuffle = torch.Generator().manual_seed(cfg.run.seed * 1_000_003 + step)
    metrics.update(parallel_learner.update(setup.policy, batch, cfg.ppo, cfg.rollout.temperature, shuffle))
    if setup.critic_policy is not None:  # the same mini-batches as the policy's
        shuffle = torch.Generator().manual_seed(cfg.run.seed * 1_000_003 + step)
        metrics.update(critic_update(setup.critic_policy, batch, cfg.ppo, cfg.critic.value_clip, shuffle))
    t3 = time.perf_counter()
    buffer.wait()  # the batches generated ahead meanwhile, before the engine's weights change
    memory.update(setup.wake_engine())
    with buffer.exclusive():  # no trajectory turn between the new weights and their version
        memory.update(setup.sync())  # sync/bytes: what this rank's engine shard received
        buffer.weights_are(step)  # the engine holds version `step`; rows in flight continue under it
    metrics.update(step_times(device, t0, t1, t2, t3))
    metrics.update(idle_fractions(time.perf_counter() - t0, buffer.busy_s(), t3 - t1))
    metrics.update(rollout_metrics(batch, rollouts.scores, kept.keep))
    metrics.update(rollout_extra)
    metrics.update(kept.metrics())
    metrics.update(memory)
    if isinstance(rollout, AgentRollout):
        metrics.update(agent_metrics(generations, rollouts.rewards))  # type: ignore[arg-type]
        metrics.update(rollout.tool_metrics())
    return metrics


def supervised_batch(
    cfg: TrainConfig, task, conversations: ConversationSet | None, step: int, replicas: int
) -> RolloutBatch:
    """The step's supervised rows, a pure function of the step: task prompts with their reference
    responses (loss on the responses), harmony conversations (loss on the tokens the assistant samples),
    or synthetic documents (loss on all but their first token)."""
    if cfg.sft.data == "synthetic":
        budgets = cfg.sft.micro_batches * replicas
        firsts, rests = progression_documents(
            step, cfg.run.seed, cfg.model.vocab_size, cfg.sft.token_budget, budgets
        )
        return build_batch(firsts, rests, [[0.0] * len(r) for r in rests], [0.0] * len(rests))
    if conversations is not None:
        examples = conversations.batch(step, cfg.sft.examples_per_step)
        responses = [e.response for e in examples]
        return build_batch(
            [e.prompt for e in examples],
            responses,
            [[0.0] * len(r) for r in responses],
            [0.0] * len(examples),
            [e.response_mask for e in examples],
        )
    prompts = task.sample_prompts(cfg.sft.examples_per_step, random.Random(cfg.env.seed * 1_000_003 + step))
    responses = [task.reference_response(p) for p in prompts]
    prompt_ids = [list(p.token_ids) for p in prompts]
    return build_batch(prompt_ids, responses, [[0.0] * len(r) for r in responses], [0.0] * len(prompts))


def trained_tokens(conversations: ConversationSet | None) -> torch.Tensor:
    """Every token id the conversations train on (int64, ascending; empty without conversations): the rows a
    sampled softmax always scores, so the tokens the data teaches always compete with each other."""
    if conversations is None:
        return torch.zeros(0, dtype=torch.long)
    ids = {t for e in conversations.examples for t, trained in zip(e.token_ids, e.trained) if trained}
    return torch.tensor(sorted(ids), dtype=torch.long)


def step_vocab_sample(cfg: TrainConfig, batch: RolloutBatch, always: torch.Tensor, step: int) -> VocabSample:
    """The sampled softmax's rows of a supervised step (`sft.sampled_vocab`): the batch's loss targets,
    `always`, and sft.sampled_vocab rows drawn from the rest with a generator seeded by (run.seed, step)."""
    targets = batch.targets.masked_fill(batch.loss_mask == 0, -1).reshape(-1)
    draws = torch.Generator().manual_seed(cfg.run.seed * 1_000_003 + step)
    return draw_vocab_sample(torch.cat([targets, always]), cfg.model.vocab_size, cfg.sft.sampled_vocab, draws)


def step_times(device: torch.device, t0: float, t1: float, t2: float, t3: float) -> dict[str, float]:
    """The time of each phase (the sync timed to its end on GPUs) and, on GPUs, the largest peak memory of
    any rank over the step (learner and engine together): allocated (`perf/peak_gib`) and held by the caching
    allocator (`perf/reserved_gib`, what the device must have)."""
    out: dict[str, float] = {}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        peak = torch.tensor(
            [torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)],
            dtype=torch.float64,
            device=device,
        ).div_(1024**3)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        out["perf/peak_gib"], out["perf/reserved_gib"] = peak.tolist()
        torch.cuda.reset_peak_memory_stats(device)
    t4 = time.perf_counter()
    out.update({"time/generate_s": t1 - t0, "time/logprobs_s": t2 - t1, "time/update_s": t3 - t2})
    out["time/sync_s"] = t4 - t3
    return out
