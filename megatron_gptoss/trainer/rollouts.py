"""The step's scored rollouts: prompts -> generations -> rewards (the task's, plus DAPO's overlong penalty),
and DAPO's dynamic sampling.

    round 0      `rollout.prompts_per_step` prompts x `n_samples_per_prompt` samples (the plain step)
    dynamic      groups whose rewards are all equal are dropped; while fewer than `prompts_per_step` groups
    sampling     remain and `dapo.max_extra_rounds` allows, another round of fresh prompts is generated and
                 filtered; the batch is the first `prompts_per_step` kept groups (all of round 0's groups
                 when no group of any round differs)

Every round is collective and every decision is taken on values identical on all ranks (the scores come
from rank 0), so all ranks run the same rounds. Prompts and sampling seeds depend only on (step, round).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_gptoss.config import TrainConfig
from megatron_gptoss.engine_api.protocol import Generation, SamplingParams
from megatron_gptoss.rl.dapo import overlong_penalty, uniform_groups
from megatron_gptoss.trainer.session import from_rank0

# reward metrics that count events (summed over rounds); the others are row-weighted means
_COUNTS = (
    "reward/errors", "reward/timeouts", "reward/nonfinite", "reward/failed", "reward/rows", "reward/reason/"
)  # fmt: skip


@dataclass
class Rollouts:
    """Rows of a step, `group` consecutive rows per prompt."""

    prompts: list  # the task's prompt object of each row
    generations: list[Generation]
    scores: list[dict]  # the task's score of each row ("reward", "correct")
    rewards: list[float]  # the task's reward plus the overlong penalty
    penalties: list[float]  # the overlong penalty of each row (<= 0)
    reward_metrics: list[tuple[int, dict[str, float]]] = field(default_factory=list)  # (rows, metrics)

    @property
    def prompt_ids(self) -> list[list[int]]:
        return [list(p.token_ids) for p in self.prompts]

    def groups(self, index: list[int], group: int) -> Rollouts:
        rows = [g * group + i for g in index for i in range(group)]
        pick = lambda xs: [xs[r] for r in rows]  # noqa: E731
        return Rollouts(
            pick(self.prompts),
            pick(self.generations),
            pick(self.scores),
            pick(self.rewards),
            pick(self.penalties),
            self.reward_metrics,
        )

    def __add__(self, other: Rollouts) -> Rollouts:
        return Rollouts(
            self.prompts + other.prompts,
            self.generations + other.generations,
            self.scores + other.scores,
            self.rewards + other.rewards,
            self.penalties + other.penalties,
            self.reward_metrics + other.reward_metrics,
        )


def collect_rollouts(
    cfg: TrainConfig, engine, task, sampling: SamplingParams, step: int
) -> tuple[Rollouts, dict[str, float]]:
    """The step's rollouts and their metrics (the task's reward metrics over every round, `dapo/*`)."""
    group, wanted = cfg.rollout.n_samples_per_prompt, cfg.rollout.prompts_per_step
    first = generate_round(cfg, engine, task, sampling, step, 0)
    metrics: dict[str, float] = {}
    result = first
    if cfg.dapo.dynamic_sampling:
        uniform = uniform_groups(torch.tensor(first.rewards, dtype=torch.float64), group)
        kept = first.groups((~uniform).nonzero().flatten().tolist(), group)
        generated, uniform_count, rounds = wanted, int(uniform.sum()), 1
        while len(kept.rewards) < wanted * group and rounds <= cfg.dapo.max_extra_rounds:
            more = generate_round(cfg, engine, task, sampling, step, rounds)
            uniform = uniform_groups(torch.tensor(more.rewards, dtype=torch.float64), group)
            kept = kept + more.groups((~uniform).nonzero().flatten().tolist(), group)
            generated, uniform_count, rounds = (
                generated + wanted,
                uniform_count + int(uniform.sum()),
                rounds + 1,
            )
        groups = len(kept.rewards) // group
        result = kept.groups(list(range(min(groups, wanted))), group) if groups else first
        metrics.update(
            {
                "dapo/rounds": float(rounds),
                "dapo/uniform_group_frac": uniform_count / generated,
                "dapo/kept_groups": float(min(groups, wanted)),
                "dapo/batch_groups": float(len(result.rewards) // group),
            }
        )
    metrics.update(batch_metrics(cfg, result))
    return result, metrics


def batch_metrics(cfg: TrainConfig, result: Rollouts) -> dict[str, float]:
    """The overlong penalty's metrics (`dapo.overlong_buffer`) and the task's reward metrics of a batch."""
    metrics: dict[str, float] = {}
    if cfg.dapo.overlong_buffer:
        penalties = torch.tensor(result.penalties)
        metrics["dapo/overlong_frac"] = float((penalties < 0).double().mean())
        metrics["dapo/overlong_penalty_mean"] = float(penalties.double().mean())
    metrics.update(combine_reward_metrics(result.reward_metrics))
    return metrics


def generate_round(
    cfg: TrainConfig, engine, task, sampling: SamplingParams, step: int, round_: int
) -> Rollouts:
    """One round of prompts, generations (collective) and scores (rank 0's, on every rank). Round 0 draws
    the step's prompts from a generator seeded by (env.seed, step) and samples row i with seed
    (run.seed, step) + i; round k > 0 draws from a generator seeded by (env.seed, step, k) and offsets the
    row seeds by k x rows."""
    rows, params = draw_round(cfg, task, sampling, step, round_)
    generations = engine.generate([list(p.token_ids) for p in rows], params)
    return score_round(cfg, task, rows, generations)


def draw_round(
    cfg: TrainConfig, task, sampling: SamplingParams, step: int, round_: int
) -> tuple[list, SamplingParams]:
    """A round's rows (`n_samples_per_prompt` consecutive rows per prompt) and their sampling parameters
    (row i samples from the stream `params.seed + i`), as `generate_round` describes."""
    group = cfg.rollout.n_samples_per_prompt
    seed = cfg.env.seed * 1_000_003 + step
    rng = random.Random(seed) if round_ == 0 else random.Random(f"dapo:{seed}:{round_}")
    prompts = task.sample_prompts(cfg.rollout.prompts_per_step, rng)
    rows = [p for p in prompts for _ in range(group)]
    return rows, SamplingParams(**{**sampling.__dict__, "seed": seed_base(cfg, step, round_, len(rows))})


def seed_base(cfg: TrainConfig, step: int, round_: int, rows: int) -> int:
    """Row i of round `round_` of data step `step` (`rows` rows a round) samples from the stream
    seed_base + i."""
    return (cfg.run.seed << 40) + (step << 20) + round_ * rows


def score_round(cfg: TrainConfig, task, rows: list, generations: list[Generation]) -> Rollouts:
    """The rows' scores (rank 0's, on every rank) and rewards: the task's plus DAPO's overlong penalty."""
    scores, reward_metrics = score_on_rank0(task, rows, [g.token_ids for g in generations])
    lengths = torch.tensor([len(g.token_ids) for g in generations])
    dapo = cfg.dapo
    penalty = overlong_penalty(
        lengths, cfg.rollout.max_new_tokens, dapo.overlong_buffer, dapo.overlong_penalty
    )
    rewards = [float(s["reward"]) + float(p) for s, p in zip(scores, penalty)]
    return Rollouts(rows, generations, scores, rewards, penalty.tolist(), [(len(rows), reward_metrics)])


def score_on_rank0(task, prompts, responses) -> tuple[list[dict], dict[str, float]]:
    """The task's scores of every row, computed once on rank 0 (its reward workers) and sent to every rank."""
    return from_rank0(task.score_batch(prompts, responses) if dist.get_rank() == 0 else None)


def combine_reward_metrics(parts: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """The task's reward metrics of several rounds: event counts summed, the rest weighted by rows."""
    if len(parts) == 1:
        return dict(parts[0][1])
    out: dict[str, float] = {}
    rows: dict[str, int] = {}
    for n, metrics in parts:
        for key, value in metrics.items():
            weight = 1 if key.startswith(_COUNTS) else n
            out[key] = out.get(key, 0.0) + weight * value
            rows[key] = rows.get(key, 0) + n
    return {k: v if k.startswith(_COUNTS) else v / rows[k] for k, v in out.items()}
