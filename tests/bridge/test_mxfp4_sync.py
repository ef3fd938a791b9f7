"""Weight sync into an engine holding MXFP4 experts (`rollout.expert_format: mxfp4`): the bridge quantizes
the learner's expert weights (`hf.mxfp4.quantize_mxfp4`) and sends `<name>_blocks` / `<name>_scales` in the
released checkpoints' layout; the engine copies the bytes into its MXFP4 weights.

- plan (pure): expert weights become blocks + scales transfers (uint8, packed shapes, whole or sliced),
  biases and dense tensors do not; bucket bounds count the packed bytes.
- export: the packed pairs equal `pack_expert_weight` of the HF tensors, from one process and from an
  ep2 / tp2 learner (gathered on dst).
- a learner holding MXFP4 experts itself (LoRA over a 4-bit base) exports them dequantized, adapters merged,
  or re-quantized for an MXFP4 engine.
- fan-out on 2 gloo ranks, ep2 learner into ep2 (bytes held as released, pairs, tiled pairs) and
  tp1-replica engines: after a sync every engine rank's blocks and scales equal `quantize_mxfp4` of the
  learner's weights (its experts) in the engine's held format, its dense parameters the learner's; the
  engine generates.
"""

import dataclasses

import pytest
import torch
from helpers.bridge_layouts import _stages, export_layout
from helpers.harness import pool

from megatron_gptoss.bridge.export import WeightExporter
from megatron_gptoss.bridge.fanout import FanoutExporter
from megatron_gptoss.bridge.plan import EngineLayout, plan_transfers
from megatron_gptoss.config import ParallelConfig, gpt_oss_tiny
from megatron_gptoss.hf.convert import iter_hf_tensors
from megatron_gptoss.hf.mxfp4 import pack_expert_weight, quantize_mxfp4
from megatron_gptoss.model import build_model
from megatron_gptoss.model.mxfp4_weight import mxfp4_weights
from megatron_gptoss.ops.mxfp4_bytes import pair_words, tile_experts
from megatron_gptoss.parallel.dims import Layout, ParallelDims
from megatron_gptoss.rollout import SamplingParams
from megatron_gptoss.rollout.parallel_embedded import ParallelEmbeddedEngine

CONFIG = gpt_oss_tiny(num_experts=8, hidden_size=64, intermediate_size=64)  # whole tiles for "tiled_pairs"
PACKED = EngineLayout(expert_format="mxfp4")
BUCKET = 8 * 1024
TIMEOUT = 180.0


def learner_model(seed: int = 1):
    model = build_model(CONFIG, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))  # off any MXFP4 grid
    return model


def expected_pairs(model) -> dict[str, torch.Tensor]:
    """HF tensors of `model`, each expert weight as the released checkpoints store it."""
    out = {}
    for name, tensor in iter_hf_tensors(model, CONFIG):
        if name.endswith(("gate_up_proj", "down_proj")):
            out[name + "_blocks"], out[name + "_scales"] = pack_expert_weight(tensor)
        else:
            out[name] = tensor
    return out


def test_plan_sends_expert_weights_as_blocks_and_scales():
    from bridge.test_plan import holdings

    layout = Layout(2, 1, 1, 2)
    plan = plan_transfers(layout, EngineLayout(2, 2, True, "mxfp4"), holdings(layout, CONFIG), CONFIG, 2048)
    fc1 = [t for t in plan if t.ours == "decoder.layers.0.mlp.experts.linear_fc1.weight"]
    assert fc1 and all(t.dtype == "uint8" for t in fc1)
    first = fc1[0]
    start, stop = first.experts
    assert first.names == (
        f"model.layers.0.mlp.experts.gate_up_proj_blocks[{start}:{stop}]",
        f"model.layers.0.mlp.experts.gate_up_proj_scales[{start}:{stop}]",
    )
    rows, groups = 2 * CONFIG.intermediate_size, CONFIG.hidden_size // 32  # fc1: [gate; up] x hidden
    assert first.shapes == ((stop - start, rows, groups, 16), (stop - start, rows, groups))
    assert sum(t.experts[1] - t.experts[0] for t in fc1) == 8
    assert first.nbytes <= 2048 or stop - start == 1  # the bucket bound counts the packed bytes
    bias = next(t for t in plan if t.ours == "decoder.layers.0.mlp.experts.linear_fc1.bias")
    assert bias.dtype == "float32" and "_blocks" not in bias.names[0]
    whole = plan_transfers(Layout(1, 1, 1, 1), PACKED, holdings(Layout(1, 1, 1, 1), CONFIG), CONFIG, 2048)
    fc2 = next(t for t in whole if t.ours == "decoder.layers.1.mlp.experts.linear_fc2.weight")
    assert fc2.names == (
        "model.layers.1.mlp.experts.down_proj_blocks",
        "model.layers.1.mlp.experts.down_proj_scales",
    )
    with pytest.raises(ValueError, match="expert_format='fp8'"):
        plan_transfers(Layout(1, 1, 1, 1), EngineLayout(expert_format="fp8"), {}, CONFIG, 2048)


@pytest.mark.parametrize("layout", [None, "ep2", "tp2"])
def test_export_quantizes_expert_weights_as_the_release_stores_them(layout):
    model = learner_model()
    if layout is None:
        pairs = list(WeightExporter([model], CONFIG, None, PACKED, BUCKET).pairs())
    else:
        pairs = export_layout(layout, CONFIG, model, PACKED, BUCKET)
    expected = expected_pairs(model)
    assert sorted(n for n, _ in pairs) == sorted(expected)
    for name, tensor in pairs:
        assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name]), name
    assert any(name.endswith("_blocks") for name, _ in pairs)


def test_mxfp4_learner_exports_its_experts_dequantized_and_merged():
    from helpers.hf_checkpoints import released_blocks

    from megatron_gptoss.config.lora import LORA_TARGETS, LoRAConfig
    from megatron_gptoss.hf.names import match_ours, to_hf
    from megatron_gptoss.model import GPTOSSModel

    config = dataclasses.replace(
        CONFIG, expert_format="mxfp4", lora=LoRAConfig(rank=2, alpha=4.0, targets=list(LORA_TARGETS))
    )
    model = GPTOSSModel(config)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))  # adapters' B non-zero: the merge matters
        for weight in mxfp4_weights(model).values():
            weight.copy_packed_(*released_blocks(gen, tuple(weight.scales.shape), scale_range=(118, 122)))
    params = dict(model.named_parameters())
    expected = {}
    for name, weight in mxfp4_weights(model).items():
        prefix = name.removesuffix(".weight") + ".lora"
        a, b = params[prefix + ".a"].double(), params[prefix + ".b"].double()
        merged = (weight.dequantize(torch.float64) + config.lora.scale * b @ a).float()
        ((hf, tensor),) = to_hf(match_ours(name), merged, config)
        expected[hf] = tensor
    dense = dict(WeightExporter([model], config, None, EngineLayout(), BUCKET).pairs())
    packed = dict(WeightExporter([model], config, None, PACKED, BUCKET).pairs())
    assert not any("lora" in n for n in dense) and len(expected) == 2 * config.num_layers
    for hf, tensor in expected.items():
        assert (dense[hf] - tensor).abs().max() < 1e-6, hf
        blocks, scales = pack_expert_weight(dense[hf])
        assert torch.equal(packed[hf + "_blocks"], blocks) and torch.equal(packed[hf + "_scales"], scales)
        assert hf not in packed


def fanout_on_ranks(state, engines):
    """(Every rank) an ep2 learner holding `state`; for each engine layout: a fan-out sync into an engine with
    MXFP4 experts, then its MXFP4 buffers and dense parameters against the learner's, and a generation."""
    config = CONFIG
    chunks, dims = _stages(config, state, {"expert_model_parallel_size": 2})
    out = {}
    for key, parallel in engines.items():
        byte_format = parallel.pop("byte_format", "checkpoint")
        edims = ParallelDims.build(ParallelConfig(**parallel), config)
        engine_config = dataclasses.replace(config, expert_format="mxfp4", mxfp4_byte_format=byte_format)
        engine = ParallelEmbeddedEngine(engine_config, edims)
        target = EngineLayout(dims.layout.world, edims.ep, True, "mxfp4")
        exporter = FanoutExporter(chunks, config, dims, target, BUCKET)
        received = list(exporter.pairs())
        engine.update_weights(iter(received))
        wrong = []
        for name, weight in mxfp4_weights(engine.model).items():
            local = weight.shape[0]
            first = edims.coord("ep") * local
            blocks, scales = quantize_mxfp4(state[name][first : first + local])  # our [gate; up] rows
            if byte_format != "checkpoint":  # the engine's re-encoding (and tiling)
                blocks = pair_words(blocks)
            if byte_format == "tiled_pairs":
                blocks, scales = tile_experts(blocks), tile_experts(scales)
            if not (torch.equal(weight.blocks, blocks) and torch.equal(weight.scales, scales)):
                wrong.append(name)
        for name, param in engine.model.named_parameters():
            if ".mlp.experts." in name and name.endswith(".bias"):
                local = param.shape[0]
                first = edims.coord("ep") * local
                if not torch.equal(param, state[name][first : first + local]):
                    wrong.append(name)
        packed = sum(t.numel() for n, t in received if "_blocks" in n or "_scales" in n)
        gen = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, seed=0))[0]
        out[key] = {
            "wrong": wrong,
            "mxfp4": len(mxfp4_weights(engine.model)),
            "packed_bytes": packed,
            "float_expert_weights": [n for n, _ in received if n.split("[")[0].endswith(("_proj",))],
            "logprobs": gen.logprobs,
        }
        engine.shutdown()
    return out


def test_fanout_fills_the_engine_blocks_with_the_quantized_learner_weights():
    model = learner_model()
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    engines = {
        "ep2": dict(expert_model_parallel_size=2), "tp1": {},
        "ep2-pairs": dict(expert_model_parallel_size=2, byte_format="pairs"),  # `model.mxfp4_byte_format`
        "ep2-tiled": dict(expert_model_parallel_size=2, byte_format="tiled_pairs"),
    }  # fmt: skip
    per_rank = pool(2).run(fanout_on_ranks, state, engines, timeout=TIMEOUT)
    for rank, result in enumerate(per_rank):
        for key, got in result.items():
            assert got["mxfp4"] == 2 * CONFIG.num_layers and not got["wrong"], (rank, key, got["wrong"])
            assert not got["float_expert_weights"], got["float_expert_weights"]
            # 4.25 bits a value: an ep2 engine rank takes half the experts, a tp1 replica all of them
            values = (
                CONFIG.num_layers * 3 * CONFIG.intermediate_size * CONFIG.hidden_size * CONFIG.num_experts
            )
            share = values // 2 if key.startswith("ep2") else values
            assert got["packed_bytes"] == share * 17 // 32, (key, got["packed_bytes"])
            assert len(got["logprobs"]) == 4 and all(lp <= 0 for lp in got["logprobs"])
