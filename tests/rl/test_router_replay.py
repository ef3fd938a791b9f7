"""Router replay (`moe.router_replay`), fp32, against a routing that a tiny perturbation flips.

Every layer's router has two experts whose router rows are equal (an exact tie), broken by a bias of
DELTA: the learner prefers expert 1, the "engine" (the same weights but for those two biases) expert 2.
Tokens with the two experts at the top-k boundary are routed differently (not only gated differently),
so without replay the learner's log-probs differ from the engine's by far more than DELTA; with r3 (the
engine's experts replayed) they agree within 1e-6. r2: the old-policy pass records the learner's own
experts; after the same tiny perturbation of the learner, replaying them reproduces the old log-probs.
Single process (the gates' gradient against float64) and on 4 gloo ranks under ep2, pp2 and tp2 x ep2
(tokens split over tp) and tp2 x sp x ep2 (sequence parallel)."""

from __future__ import annotations

import pytest
import torch
from helpers.harness import pool
from helpers.router_ties import DELTA, tied
from helpers.sharded import build_dims, reference_model, tiny_config

from megatron_gptoss.config import PPOConfig
from megatron_gptoss.config.model import ModelConfig
from megatron_gptoss.config.moe import MoEReplayConfig
from megatron_gptoss.model.gpt_oss import GPTOSSModel
from megatron_gptoss.model.moe import Router, no_route
from megatron_gptoss.parallel.apply import parallelize
from megatron_gptoss.parallel.pipeline import PipelineRunner, build_stage_model, stage_plans
from megatron_gptoss.parallel.sharding import get_shard, local_shard
from megatron_gptoss.rl import parallel_learner
from megatron_gptoss.rl.batch import RolloutBatch, build_batch, packed_logprobs

SEED, LAYERS, VOCAB, TEMPERATURE, GROUP = 3, 2, 96, 1.0, 2
PPO = PPOConfig(correction_mode="none")


def config() -> ModelConfig:
    return tiny_config(num_layers=LAYERS)


def full_model(prefer: int) -> GPTOSSModel:
    return tied(reference_model(SEED, config()), prefer)


def rows() -> tuple[list[list[int]], list[list[int]]]:
    gen = torch.Generator().manual_seed(11)
    prompts, responses = [], []
    for p in range(3):
        prompt = torch.randint(1, VOCAB, (3 + p,), generator=gen).tolist()
        for _ in range(GROUP):
            n = int(torch.randint(4, 9, (1,), generator=gen))
            prompts.append(prompt)
            responses.append(torch.randint(1, VOCAB, (n,), generator=gen).tolist())
    return prompts, responses


def routed(model: GPTOSSModel, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Single-process log-probs [B, T] and the experts every input token was routed to [B, T, L, k]."""
    routers = [layer.mlp.router for layer in model.decoder.layers.values()]
    captured: list[list[torch.Tensor]] = [[] for _ in routers]
    for router, box in zip(routers, captured):
        router.capture = box
    try:
        with torch.no_grad():
            lp, _ = packed_logprobs(model, batch, TEMPERATURE)
    finally:
        for router in routers:
            router.capture = None
    per_token = torch.stack([box[0] for box in captured], dim=1).to(torch.uint8)  # [N, L, k]
    table = torch.full(
        (*batch.input_ids.shape, *per_token.shape[1:]), no_route(torch.uint8), dtype=torch.uint8
    )
    table[batch.valid] = per_token
    return lp, table


def engine_batch() -> RolloutBatch:
    """The rows with the engine's log-probs of the responses and its routing of every input token."""
    prompts, responses = rows()
    plain = build_batch(prompts, responses, [[0.0] * len(r) for r in responses], [0.0] * len(responses))
    lp, routing = routed(full_model(prefer=2), plain)
    logprobs, routes = [], []
    for b, (p, r) in enumerate(zip(prompts, responses)):
        logprobs.append(lp[b, len(p) - 1 : len(p) - 1 + len(r)].tolist())
        routes.append(routing[b, : len(p) + len(r) - 1])
    rewards = [float(i % 2) for i in range(len(prompts))]
    return build_batch(prompts, responses, logprobs, rewards, routing=routes)


def loss_max_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float((a - b).abs()[mask > 0].max())


# ------------------------------------------------------------------------------------------------
def test_replayed_gates_are_the_softmax_of_the_router_logits_at_the_replayed_experts():
    router = Router(config())
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
        router.bias.copy_(torch.randn(router.bias.shape, generator=gen))
    x = torch.randn(7, router.weight.shape[1], generator=gen)
    replay = torch.tensor([[0, 3], [2, 1], [1, 0], [3, 2], [0, 1], [2, 3], [255, 255]], dtype=torch.uint8)
    _, probs, indices = router(x, replay)
    own = torch.topk(x @ router.weight.t() + router.bias, 2, dim=-1).indices
    assert torch.equal(indices[:6], replay[:6].long()) and torch.equal(indices[6], own[6])
    w, b = router.weight.detach().double().requires_grad_(), router.bias.detach().double().requires_grad_()
    ref = torch.softmax((x.double() @ w.t() + b).gather(-1, indices), dim=-1)
    assert float((probs.double() - ref).norm() / ref.norm()) < 1e-6
    upstream = torch.randn(probs.shape, generator=gen)
    (probs * upstream).sum().backward()
    (ref * upstream.double()).sum().backward()
    assert router.weight.grad is not None and float(router.weight.grad.norm()) > 0
    for ours, theirs in ((router.weight.grad, w.grad), (router.bias.grad, b.grad)):
        assert float((ours.double() - theirs).norm() / theirs.norm()) < 1e-5


def test_single_process_r3_reproduces_the_engine():
    batch = engine_batch()
    learner = full_model(prefer=1)
    free, own = routed(learner, batch.with_(routing=None))
    replayed, used = routed(learner, batch)
    assert torch.equal(used, batch.routing)  # the replayed experts were used
    valid = batch.valid
    assert (own[valid] != batch.routing[valid]).any(-1).any(-1).float().mean() > 0.05  # experts flipped
    assert loss_max_diff(free, batch.rollout_logprobs, batch.loss_mask) > 1e-3
    assert loss_max_diff(replayed, batch.rollout_logprobs, batch.loss_mask) <= 1e-6


# ------------------------------------------------------------------------------------------------
def stages(dims, cfg, prefer: int):
    full = dict(full_model(prefer).named_parameters())
    plans = stage_plans(dims, LAYERS, None)
    models = []
    for plan in plans:
        model = parallelize(build_stage_model(config(), plan), dims, cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(local_shard(full[name], get_shard(p), dims, config().padded_vocab_size(dims.tp)))
        models.append(model)
    return models, plans


@torch.no_grad()
def prefer_engine(models) -> None:
    """The learner's tiny perturbation: the tie now broken towards expert 2, as the engine's."""
    for model in models:
        for layer in model.decoder.layers.values():
            layer.mlp.router.bias[1] -= DELTA
            layer.mlp.router.bias[2] += DELTA


def run_layout(parallel: dict) -> dict:
    cfg, dims = build_dims(config(), **parallel)
    models, plans = stages(dims, cfg, prefer=1)
    policy = parallel_learner.ParallelPolicy(PipelineRunner(models, plans, dims, chunk_size=16), dims)
    batch = engine_batch()
    out: dict = {}
    r3, r3_metrics = parallel_learner.prepare(
        policy, batch, PPO, TEMPERATURE, GROUP, replay=MoEReplayConfig("r3")
    )
    none, _ = parallel_learner.prepare(policy, batch.with_(routing=None), PPO, TEMPERATURE, GROUP)
    out["r3"] = loss_max_diff(r3.old_logprobs, batch.rollout_logprobs, batch.loss_mask)
    out["none"] = loss_max_diff(none.old_logprobs, batch.rollout_logprobs, batch.loss_mask)
    out["r3_metrics"] = r3_metrics
    r2, _ = parallel_learner.prepare(
        policy, batch.with_(routing=None), PPO, TEMPERATURE, GROUP, replay=MoEReplayConfig("r2")
    )
    out["r2_routing"] = r2.routing
    prefer_engine(models)  # the policy moves a little, as an update would
    out["r2_replayed"] = loss_max_diff(policy.logprobs(r2, TEMPERATURE), r2.old_logprobs, r2.loss_mask)
    free = policy.logprobs(r2.with_(routing=None), TEMPERATURE)
    out["r2_free"] = loss_max_diff(free, r2.old_logprobs, r2.loss_mask)
    return out


@pytest.fixture(scope="module")
def learner_routing():
    batch = engine_batch()
    _, own = routed(full_model(prefer=1), batch.with_(routing=None))
    return own


LAYOUTS = {
    "ep2": dict(expert_model_parallel_size=2),
    "pp2": dict(pipeline_model_parallel_size=2),
    "tp2_ep2": dict(tensor_model_parallel_size=2, expert_model_parallel_size=2),
    "tp2_sp_ep2": dict(tensor_model_parallel_size=2, expert_model_parallel_size=2, sequence_parallel=True),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_replay_under_parallel_layouts(name, learner_routing):
    for rank, out in enumerate(pool(4).run(run_layout, LAYOUTS[name])):
        assert out["none"] > 1e-3, (name, rank, out["none"])  # routing flips show without replay
        assert out["r3"] <= 1e-6, (name, rank, out["r3"])
        metrics = out["r3_metrics"]
        assert metrics["replay/flip_frac"] > 0.05 and metrics["replay/mismatch_off_abs_diff_max"] > 1e-3
        assert metrics["replay/mismatch_off_abs_diff_max"] == pytest.approx(out["none"], rel=1e-4)
        # r2 records the learner's own experts, and replaying them undoes the flips of a tiny change
        assert torch.equal(out["r2_routing"], learner_routing), (name, rank)
        assert out["r2_free"] > 1e-3 and out["r2_replayed"] <= 1e-6, (name, rank, out["r2_replayed"])
