"""Bitwise on-policy mode (`rollout.bitwise_on_policy`) at parallel layouts and with LoRA: the embedded
engine's log-prob of every sampled token equals the learner's packed training forward bit for bit, and
without the mode the same comparison is not bitwise (so each case can fail).

    lora       world 1: adapters on every target, run unmerged by the engine as by the learner, over float
               experts and over a frozen MXFP4 expert base (`model.expert_format: mxfp4`)
    tp2-sp     world 2: learner at tp 2 with sequence parallel, engine at tp 2 (row-parallel sums and
               reduce-scatters in rank order, vocab-parallel log-probs from gathered logits)
    tp2-lora   world 2: as tp2-sp, LoRA, the engine computing with the learner's base shards
    ep2        world 2: learner and engine at ep 2, each rank its own rows (tokens of both ranks meet in
               the experts; a token's k outputs summed in expert-id order)
    tp2xep2    world 4: tp 2 with sequence parallel x ep 2, two replicas of the engine

fp32 on the CPU, Triton attention under TRITON_INTERPRET=1, gloo."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
from helpers.harness import pool

from megatron_gptoss.config import (
    ConfigError,
    EmbeddedEngineConfig,
    ModelConfig,
    ParallelConfig,
    gpt_oss_tiny,
    load_config,
)
from megatron_gptoss.config.lora import LORA_TARGETS, LoRAConfig
from megatron_gptoss.hf.convert import iter_hf_tensors
from megatron_gptoss.hf.mxfp4 import quantize_mxfp4
from megatron_gptoss.model import GPTOSSModel, build_model
from megatron_gptoss.model.lora import is_adapter_param
from megatron_gptoss.model.mxfp4_weight import mxfp4_weights
from megatron_gptoss.ops import batch_invariant
from megatron_gptoss.parallel.apply import parallelize
from megatron_gptoss.parallel.dims import ParallelDims
from megatron_gptoss.parallel.sharding import get_shard, local_shard
from megatron_gptoss.rollout import EmbeddedEngine, SamplingParams
from megatron_gptoss.rollout.parallel_embedded import ParallelEmbeddedEngine

DEMO = Path(__file__).resolve().parents[2] / "configs/demo_cpu.yaml"
CONFIG = gpt_oss_tiny(attention_backend="triton")
LORA = dataclasses.replace(CONFIG, lora=LoRAConfig(rank=2, alpha=3.0, targets=list(LORA_TARGETS)))
PROMPTS = [
    torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 9, 6, 1)
]
PARAMS = SamplingParams(temperature=0.8, max_new_tokens=5, stop_token_ids=[95, 65, 19], seed=7)
OPTIONS = EmbeddedEngineConfig(max_batch_slots=2, block_size=4, max_step_tokens=6)  # chunked prefill
LAYOUTS = {
    "tp2-sp": (CONFIG, {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
    "tp2-lora": (LORA, {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
    "ep2": (CONFIG, {"expert_model_parallel_size": 2}),
    "tp2xep2": (
        CONFIG,
        {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 2, "sequence_parallel": True},
    ),
}
WORLD = {"tp2xep2": 4}  # the others: 2


def full_state(config: ModelConfig) -> dict[str, torch.Tensor]:
    """A seeded model with larger weights than the init (adapters included: b is not zero), by name."""
    model = build_model(config, seed=4)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def learner_logprobs(model, sequences, prompt_lengths, multiple: int) -> list[list[float]]:
    """The learner's packed training forward of `sequences` (one row, cu_seqlens; a padding sequence
    brings the tokens to a multiple of `multiple`): the log-prob of every token after its prompt."""
    device = next(model.parameters()).device
    tokens = sum(len(s) for s in sequences)
    pad = -tokens % multiple
    rows = sequences + ([[0] * pad] if pad else [])
    ids = torch.tensor([t for s in rows for t in s])[None]
    positions = torch.cat([torch.arange(len(s)) for s in rows])[None]
    targets = torch.full((ids.shape[1],), -1)
    start = 0
    for seq, prompt in zip(sequences, prompt_lengths):
        targets[start + prompt - 1 : start + len(seq) - 1] = torch.tensor(seq[prompt:])
        start += len(seq)
    lengths = torch.tensor([len(s) for s in rows])
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).int()])
    ids, positions, targets, cu = (t.to(device) for t in (ids, positions, targets, cu))
    with torch.no_grad():
        hidden = model.hidden_states(ids, positions, cu_seqlens=cu, max_seqlen=int(lengths.max()))
        lp, _ = model.token_logprobs(hidden[0], targets, PARAMS.temperature)
    lp = lp.cpu()
    out, start = [], 0
    for seq, prompt in zip(sequences, prompt_lengths):
        out.append(lp[start + prompt - 1 : start + len(seq) - 1].tolist())
        start += len(seq)
    return out


def same_bits(engine_lp: list[list[float]], learner_lp: list[list[float]]) -> list[bool]:
    assert [len(r) for r in engine_lp] == [len(r) for r in learner_lp]
    return [a == b for e, ll in zip(engine_lp, learner_lp) for a, b in zip(e, ll)]


# ------------------------------------------------------------------------------------------------- world 1
def compare_lora(learner: GPTOSSModel) -> list[bool]:
    """Engine (the learner's model class, adapters unmerged, as `trainer.engines` builds it when it shares
    the learner's base) against the learner, per sampled token."""
    engine = EmbeddedEngine(learner.config, options=OPTIONS)
    engine.model.load_state_dict(learner.state_dict())
    prompts = PROMPTS[:3]
    outs = engine.generate(prompts, PARAMS)
    assert len({len(o.token_ids) for o in outs}) > 1  # rows finish apart
    sequences = [p + o.token_ids for p, o in zip(prompts, outs)]
    ref = learner_logprobs(learner, sequences, [len(p) for p in prompts], 1)
    return same_bits([o.logprobs for o in outs], ref)


@pytest.mark.parametrize("experts", ["bf16", "mxfp4"])
def test_lora_engine_logprobs_equal_the_learner_bitwise(experts):
    """LoRA over float experts, and over a frozen MXFP4 expert base (both sides dequantize its blocks)."""
    state = full_state(LORA)
    assert any(is_adapter_param(n) and n.endswith(".b") and bool(t.abs().sum()) for n, t in state.items())
    learner = GPTOSSModel(dataclasses.replace(LORA, expert_format=experts))
    with torch.no_grad():
        for name, weight in mxfp4_weights(learner).items():
            weight.copy_packed_(*quantize_mxfp4(state.pop(name)))
    learner.load_state_dict(state, strict=False)
    with batch_invariant.enabled():
        assert all(compare_lora(learner))
    assert not all(compare_lora(learner))


# ------------------------------------------------------------------------------------------------- world 2, 4
def on_ranks(
    layout: str, bitwise: bool, state: dict[str, torch.Tensor], device="cpu", dtype=torch.float32
) -> list[bool]:
    """Per sampled token of this rank's engine replica: whether its log-prob is the learner's bit for bit
    (collective over the world; both sides in `dtype` on `device`)."""
    config, parallel = LAYOUTS[layout]
    cfg = ParallelConfig(**parallel)
    dims = ParallelDims.build(cfg, config)
    learner = parallelize(GPTOSSModel(config, dtype=dtype, device=device), dims, cfg)
    with torch.no_grad():
        for name, p in learner.named_parameters():
            full = state[name].to(device=device, dtype=dtype)
            p.copy_(local_shard(full, get_shard(p), dims, config.padded_vocab_size(dims.tp)))
    learner.eval()
    engine_dims = ParallelDims.build(
        ParallelConfig(tensor_model_parallel_size=dims.tp, expert_model_parallel_size=dims.ep), config
    )
    if config.lora.enabled:  # the learner's base shards themselves, the adapters copied
        base = {n: p for n, p in learner.named_parameters() if not is_adapter_param(n)}
        engine = ParallelEmbeddedEngine(config, engine_dims, dtype, device, options=OPTIONS, shared=base)
        engine.update_adapters({n: p.detach() for n, p in learner.named_parameters() if is_adapter_param(n)})
    else:
        full = GPTOSSModel(config, dtype=dtype)
        full.load_state_dict(state, strict=False)
        engine = ParallelEmbeddedEngine(config, engine_dims, dtype, device, options=OPTIONS)
        engine.update_weights(iter_hf_tensors(full, config))
    # engine replicas (ep 2 at tp 1: one per rank) take their own rows, as trainer.engines splits them
    prompts = torch.tensor_split(torch.arange(len(PROMPTS)), engine_dims.dp)[engine_dims.coord("dp")]
    mine = [PROMPTS[i] for i in prompts.tolist()]
    params = dataclasses.replace(PARAMS, seed=PARAMS.seed + int(prompts[0]))
    with batch_invariant.enabled(bitwise):
        outs = engine.generate(mine, params)
        sequences = [p + o.token_ids for p, o in zip(mine, outs)]
        ref = learner_logprobs(learner, sequences, [len(p) for p in mine], dims.tp)
    return same_bits([o.logprobs for o in outs], ref)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_engine_logprobs_equal_the_learner_bitwise_in_parallel(layout):
    state = full_state(LAYOUTS[layout][0])
    world = WORLD.get(layout, 2)
    bitwise = pool(world).run(on_ranks, layout, True, state, timeout=240.0)
    assert all(all(rank) and rank for rank in bitwise), bitwise
    default = pool(world).run(on_ranks, layout, False, state, timeout=240.0)
    assert not all(all(rank) for rank in default), default


# ------------------------------------------------------------------------------------------------- config
BITWISE = ["rollout.bitwise_on_policy=true", "model.attention_backend=triton"]


def test_matched_layouts_load_and_others_are_refused_naming_the_setting():
    tp2 = ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"]
    cfg = load_config(DEMO, [*BITWISE, *tp2, "rollout.tensor_parallel_size=2"])
    assert cfg.rollout.bitwise_on_policy and cfg.parallel.tensor_model_parallel_size == 2
    lora = ["model.lora.rank=2", "parallel.expert_model_parallel_size=2", "rollout.expert_parallel_size=2"]
    assert load_config(DEMO, [*BITWISE, *lora]).model.lora.enabled
    mxfp4_base = ["model.lora.rank=2", "model.expert_format=mxfp4"]  # both sides dequantize the same blocks
    assert load_config(DEMO, [*BITWISE, *mxfp4_base]).model.expert_format == "mxfp4"
    refused = {
        "rollout.tensor_parallel_size=1 equal to parallel.tensor_model_parallel_size=2": tp2,
        "rollout.tensor_parallel_size=2 equal to parallel.tensor_model_parallel_size=1": [
            "rollout.tensor_parallel_size=2"
        ],
        "parallel.context_parallel_size=1": ["parallel.context_parallel_size=2"],
        "rollout.expert_format='mxfp4' holds them quantized": ["rollout.expert_format=mxfp4"],
        "with model.lora: rollout.expert_parallel_size equal to parallel.expert_model_parallel_size": lora[
            :2
        ],
        "parallel.pipeline_model_parallel_size=1": [
            "model.lora.rank=2",
            "parallel.pipeline_model_parallel_size=2",
        ],
    }
    for message, overrides in refused.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(DEMO, [*BITWISE, *overrides])
