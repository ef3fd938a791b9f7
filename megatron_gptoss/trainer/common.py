"""Pieces of the RL step every loop shares: sampling parameters, rollout metrics, greedy evaluation."""

from __future__ import annotations

import math

import torch

from megatron_gptoss.agent.loop import AgentGeneration, agent_metrics
from megatron_gptoss.config import TrainConfig
from megatron_gptoss.engine_api.protocol import SamplingParams


def sampling_params(cfg: TrainConfig, stop_token_ids: list[int]) -> SamplingParams:
    """The rollout's sampling parameters (`cfg.rollout`), stopping at the task's stop tokens."""
    return SamplingParams(
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        top_k=cfg.rollout.top_k,
        max_new_tokens=cfg.rollout.max_new_tokens,
        stop_token_ids=list(stop_token_ids),
        length_median=cfg.rollout.length_median,
        length_sigma=cfg.rollout.length_sigma,
    )


def rollout_metrics(batch, scores: list[dict], keep: torch.Tensor) -> dict[str, float]:
    """Mean reward, exact accuracy and mean response length of the kept rows (`keep` [B] bool: rows of
    groups not dropped for a non-finite reward) of a scored rollout batch."""
    rows = keep.nonzero().flatten()
    return {
        "reward/train_mean": float(batch.rewards[rows].mean()),
        "train/accuracy": sum(float(scores[i]["correct"]) for i in rows.tolist()) / len(rows),
        "response/length_mean": float(batch.loss_mask[rows].sum(1).mean()),
    }


@torch.no_grad()
def evaluate(engine, task, sampling: SamplingParams) -> dict[str, float]:
    """Greedy decoding (top-k 1) of the held-out prompts: what the policy knows, without sampling noise
    (`reward/eval_mean`: the mean of the finite rewards; {} without held-out prompts). `engine`: anything
    with the engines' `generate(prompts, params)`."""
    prompts = task.eval_prompts()
    params = SamplingParams(**{**sampling.__dict__, "top_k": 1, "top_p": 1.0, "seed": 0, "length_median": 0})
    if not prompts:
        return {}
    generations = engine.generate([list(p.token_ids) for p in prompts], params)
    scores, _ = task.score_batch(prompts, [g.token_ids for g in generations])
    finite = [float(s["reward"]) for s in scores if math.isfinite(s["reward"])]
    out = {
        "eval/accuracy": sum(float(s["correct"]) for s in scores) / len(scores),
        "reward/eval_mean": sum(finite) / max(1, len(finite)),
    }
    if all(isinstance(g, AgentGeneration) for g in generations):  # agentic: how often it called a tool
        agent = agent_metrics(generations)  # type: ignore[arg-type]
        out["eval/call_rate"] = agent["agent/call_rate"]
        out["eval/tool_calls_mean"] = agent["agent/tool_calls_mean"]
    return out
