"""The embedded engine of a LoRA run sharing the learner's frozen base, on 2 gloo ranks (tp2 and ep2): its
base parameters are the learner's shards themselves, it receives only the adapters, and its log-probs equal
those of the single-process engine holding the merged weights W + scale * B A; sleeping and waking never
touch the shared base (level 2 drops only the engine's adapters, refilled by the next adapter sync), and
the engine refuses to write a shared tensor."""

import pytest
import torch
from helpers.harness import pool

from megatron_gptoss.config import ParallelConfig, gpt_oss_tiny
from megatron_gptoss.config.lora import LORA_TARGETS, LoRAConfig
from megatron_gptoss.errors import CheckpointError, EngineError
from megatron_gptoss.hf.convert import iter_hf_tensors
from megatron_gptoss.model import build_model
from megatron_gptoss.model.lora import base_config, is_adapter_param
from megatron_gptoss.parallel.apply import parallelize
from megatron_gptoss.parallel.dims import ParallelDims
from megatron_gptoss.parallel.sharding import get_shard, local_shard
from megatron_gptoss.rollout import EmbeddedEngine, SamplingParams
from megatron_gptoss.rollout.parallel_embedded import ParallelEmbeddedEngine

CONFIG = gpt_oss_tiny(lora=LoRAConfig(rank=2, alpha=3.0, targets=list(LORA_TARGETS)))
SEQUENCES = [[5, 17, 3, 40, 2, 2, 9, 61, 7, 7, 30], [11, 8, 8, 90, 12, 1]]


def learner_state() -> dict[str, torch.Tensor]:
    model = build_model(CONFIG, seed=2)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def on_ranks(parallel: dict, state: dict[str, torch.Tensor]) -> dict:
    cfg = ParallelConfig(**parallel)
    dims = ParallelDims.build(cfg, CONFIG)
    learner = parallelize(build_model(CONFIG, seed=9), dims, cfg)
    with torch.no_grad():
        for name, p in learner.named_parameters():
            p.copy_(local_shard(state[name], get_shard(p), dims, CONFIG.padded_vocab_size(dims.tp)))
    base = {n: p for n, p in learner.named_parameters() if not is_adapter_param(n)}
    adapters = {n: p.detach() for n, p in learner.named_parameters() if is_adapter_param(n)}
    engine = ParallelEmbeddedEngine(CONFIG, dims, shared=base)
    out: dict = {"bytes": engine.update_adapters(adapters)}
    own = dict(engine.model.named_parameters())
    out["shared"] = all(own[n] is p for n, p in base.items())
    out["adapters_copied"] = all(own[n].data_ptr() != t.data_ptr() for n, t in adapters.items())
    out["logprobs"] = engine.sequence_logprobs(SEQUENCES)
    before = {n: (p.data_ptr(), p.detach().clone()) for n, p in base.items()}
    engine.sleep(2)
    engine.wake_up()
    out["base_kept"] = all(
        p.data_ptr() == before[n][0] and torch.equal(p, before[n][1]) for n, p in base.items()
    )
    try:
        engine.generate([SEQUENCES[0]], SamplingParams(max_new_tokens=1))
        out["refused_without_adapters"] = False
    except EngineError:
        out["refused_without_adapters"] = True
    engine.update_adapters(adapters)
    out["logprobs_after_wake"] = engine.sequence_logprobs(SEQUENCES)
    try:
        engine.update_weights([("model.layers.0.self_attn.o_proj.weight", torch.zeros(32, 64))], strict=False)
        out["refused_write"] = False
    except CheckpointError as err:
        out["refused_write"] = "shared base" in str(err)
    return out


@pytest.mark.parametrize("layout", ["tp2", "ep2"])
def test_shared_base_engine_equals_the_merged_engine(layout):
    parallel = {"tp2": {"tensor_model_parallel_size": 2}, "ep2": {"expert_model_parallel_size": 2}}[layout]
    state = learner_state()
    merged = build_model(base_config(CONFIG))
    with torch.no_grad():
        for name, p in merged.named_parameters():
            w, prefix = state[name].double(), name.removesuffix(".weight") + ".lora"
            if name.endswith(".weight") and f"{prefix}.a" in state:
                w = w + CONFIG.lora.scale * state[f"{prefix}.b"].double() @ state[f"{prefix}.a"].double()
            p.copy_(w)
    reference = EmbeddedEngine(base_config(CONFIG))
    reference.update_weights(iter_hf_tensors(merged, merged.config))
    expected = torch.tensor([x for row in reference.sequence_logprobs(SEQUENCES) for x in row])
    adapter_bytes = sum(t.numel() * t.element_size() for n, t in state.items() if is_adapter_param(n))
    for out in pool(2).run(on_ranks, parallel, state, timeout=180.0):
        flags = ("shared", "adapters_copied", "base_kept", "refused_without_adapters", "refused_write")
        assert all(out[f] for f in flags), {f: out[f] for f in flags}
        assert 0 < out["bytes"] <= adapter_bytes
        for key in ("logprobs", "logprobs_after_wake"):
            got = torch.tensor([x for row in out[key] for x in row])
            err = float((got.double() - expected.double()).norm() / expected.double().norm())
            assert err < 1e-5, (layout, key, err)
