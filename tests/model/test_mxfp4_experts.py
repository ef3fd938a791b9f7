"""MXFP4 experts (`model.expert_format: mxfp4`): LoRA over the 4-bit base equals LoRA over its dequantized
base; a released-layout HF checkpoint loads its blocks and scales bytes as they are; the random
initialisation is the float one quantized once; a full-parameter run asking for it is refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.hf_checkpoints import write_mxfp4_checkpoint
from helpers.sharded import reference_model, rel_err, tiny_config
from safetensors import safe_open

from megatron_gptoss.config import ConfigError, TrainConfig
from megatron_gptoss.config.lora import LORA_TARGETS, LoRAConfig
from megatron_gptoss.hf import load_hf, quantize_mxfp4, save_hf
from megatron_gptoss.hf.mxfp4 import dequantize_mxfp4
from megatron_gptoss.model import GPTOSSModel
from megatron_gptoss.model.lora import is_adapter_param
from megatron_gptoss.model.mxfp4_weight import MXFP4Weight, frozen_base, mxfp4_weights
from megatron_gptoss.ops.mxfp4_bytes import pair_words, tile_experts
from megatron_gptoss.parallel.dims import Layout, ParallelDims
from megatron_gptoss.parallel.loading import init_parallel, load_hf_parallel

ONE = ParallelDims(Layout(world=1, tp=1, pp=1, ep=1), rank=0)
LORA = LoRAConfig(rank=4, alpha=8.0, targets=list(LORA_TARGETS))


def _pair(backend: str, seed: int = 0) -> tuple[GPTOSSModel, GPTOSSModel]:
    """(LoRA over MXFP4 experts, LoRA over their dequantized fp32 experts): same base values, same adapters
    (B random, so every adapter gets a gradient)."""
    base = reference_model(seed, tiny_config(expert_backend=backend, num_layers=1))
    packed = GPTOSSModel(dataclasses.replace(base.config, lora=LORA, expert_format="mxfp4"))
    dense = GPTOSSModel(dataclasses.replace(base.config, lora=LORA))
    source = dict(base.named_parameters())
    gen = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, weight in mxfp4_weights(packed).items():
            weight.copy_packed_(*quantize_mxfp4(source[name]))
            dict(dense.named_parameters())[name].copy_(weight.dequantize(torch.float32))
        dense_params = dict(dense.named_parameters())
        for name, p in packed.named_parameters():
            value = torch.randn(p.shape, generator=gen) * 0.1 if is_adapter_param(name) else source[name]
            p.copy_(value)
            dense_params[name].copy_(value)
    return packed, dense


def _loss_and_adapter_grads(model: GPTOSSModel, tokens: torch.Tensor):
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1)
    )
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("backend", ["loop", "grouped_mm"])
def test_lora_over_mxfp4_experts_equals_lora_over_the_dequantized_base(backend):
    packed, dense = _pair(backend)
    assert not any(isinstance(p, MXFP4Weight) for p in packed.parameters())
    assert all(is_adapter_param(n) for n, p in packed.named_parameters() if p.requires_grad)
    tokens = torch.randint(0, packed.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    loss_q, grads_q = _loss_and_adapter_grads(packed, tokens)
    loss_d, grads_d = _loss_and_adapter_grads(dense, tokens)
    assert sorted(grads_q) == sorted(grads_d) and any(".experts.linear_fc1.lora" in n for n in grads_q)
    assert rel_err(loss_q, loss_d) <= 1e-6
    for name in grads_q:
        assert grads_q[name] is not None and grads_q[name].abs().sum() > 0, name
        assert rel_err(grads_q[name], grads_d[name]) <= 1e-6, name


def _hf_blocks(path, name: str) -> torch.Tensor:
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            if name in handle.keys():
                return handle.get_tensor(name)
    raise KeyError(name)


def test_released_layout_checkpoint_loads_its_bytes_and_equals_the_dequantized_load(tmp_path):
    ref = reference_model(1, tiny_config())
    path = write_mxfp4_checkpoint(ref, tmp_path / "mxfp4")
    config = dataclasses.replace(ref.config, lora=LORA, expert_format="mxfp4")
    packed = GPTOSSModel(config)
    stats = load_hf_parallel([packed], path, ONE, config)
    weights = mxfp4_weights(packed)
    base_params = [n for n, _ in packed.named_parameters() if not is_adapter_param(n)]
    assert stats["tensors"] == len(base_params) + len(weights) and len(weights) == 2 * config.num_layers
    for layer in range(config.num_layers):
        for ours, hf, interleaved in (
            ("linear_fc1", "gate_up_proj", True),
            ("linear_fc2", "down_proj", False),
        ):
            weight = weights[f"decoder.layers.{layer}.mlp.experts.{ours}.weight"]
            for part in ("blocks", "scales"):
                stored = _hf_blocks(path, f"model.layers.{layer}.mlp.experts.{hf}_{part}")
                if interleaved:  # HF rows gate 0, up 0, gate 1, ... -> ours [gate; up]
                    stored = torch.cat([stored[:, 0::2], stored[:, 1::2]], dim=1)
                assert getattr(weight, part).dtype == torch.uint8
                assert torch.equal(getattr(weight, part), stored), (layer, ours, part)
    dense = GPTOSSModel(dataclasses.replace(config, expert_format="bf16"))
    assert load_hf_parallel([dense], path, ONE, dense.config)["tensors"] == len(base_params) + len(weights)
    dense_params = dict(dense.named_parameters())
    for name, weight in weights.items():
        assert torch.equal(weight.dequantize(torch.float32), dense_params[name]), name
    for name, p in packed.named_parameters():
        if not is_adapter_param(name):
            assert torch.equal(p, dense_params[name]), name
    with torch.no_grad():
        for name, p in packed.named_parameters():  # the same adapters on both
            if is_adapter_param(name):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
                dense_params[name].copy_(p)
        tokens = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
        assert rel_err(packed(tokens), dense(tokens)) <= 1e-6
        # exported (experts dequantized, adapters merged), it loads as the plain model it computes
        exported = load_hf(save_hf(packed, tmp_path / "export", dtype=torch.float32))
        assert rel_err(exported(tokens), packed(tokens)) <= 1e-5


def test_a_float_checkpoint_loads_as_its_quantized_experts(tmp_path):
    ref = reference_model(2, tiny_config())
    path = save_hf(ref, tmp_path / "bf16", dtype=torch.float32)
    config = dataclasses.replace(ref.config, lora=LORA, expert_format="mxfp4")
    packed = GPTOSSModel(config)
    load_hf_parallel([packed], path, ONE, config)
    source = dict(ref.named_parameters())
    for name, weight in mxfp4_weights(packed).items():
        blocks, scales = quantize_mxfp4(source[name])
        assert torch.equal(weight.blocks, blocks) and torch.equal(weight.scales, scales), name


def test_random_initialisation_is_the_float_one_quantized_once():
    from megatron_gptoss.parallel.sharding import ShardSpec, set_shard

    config = tiny_config(lora=LORA)
    dense = GPTOSSModel(config)
    for name, p in dense.named_parameters():  # the experts' tags, as expert parallelism sets them at ep 1
        if ".mlp.experts." in name and not is_adapter_param(name):
            set_shard(p, ShardSpec(0, "ep"))
    packed = GPTOSSModel(dataclasses.replace(config, expert_format="mxfp4"))
    init_parallel([dense], config, ONE, seed=5)
    init_parallel([packed], packed.config, ONE, seed=5)
    dense_params = dict(dense.named_parameters())
    for name, weight in mxfp4_weights(packed).items():
        blocks, scales = quantize_mxfp4(dense_params[name])
        assert torch.equal(weight.blocks, blocks) and torch.equal(weight.scales, scales), name
        assert torch.equal(weight.dequantize(torch.float32), dequantize_mxfp4(blocks, scales, torch.float32))
        assert weight.scales.any()  # drawn, not left zero
    for name, p in packed.named_parameters():
        assert torch.equal(p, dense_params[name]), name
    with pytest.raises(ValueError, match="init_parallel"):
        packed.init_weights()


def test_frozen_base_holds_the_mxfp4_buffers_not_the_adapters():
    packed, _ = _pair("loop")
    base = frozen_base(packed)
    weights = mxfp4_weights(packed)
    for name, weight in weights.items():
        assert base[f"{name}.blocks"] is weight.blocks and base[f"{name}.scales"] is weight.scales
    assert not any(is_adapter_param(n) for n in base)
    assert not any(n in base for n in weights)  # the logical weights are no tensors of the model


def test_a_full_parameter_run_asking_for_mxfp4_experts_is_refused():
    with pytest.raises(ConfigError, match=r"model.expert_format='mxfp4'.*LoRA.*rollout.expert_format"):
        TrainConfig(model=tiny_config(expert_format="mxfp4")).validate()
    TrainConfig(model=tiny_config(expert_format="mxfp4", lora=LORA)).validate()
    with pytest.raises(ConfigError, match="expert_format"):
        tiny_config(expert_format="fp8")
    with pytest.raises(ConfigError, match="intermediate_size=48 is not a multiple"):
        tiny_config(expert_format="mxfp4", intermediate_size=48)


def test_weight_bytes_count_mxfp4_experts_at_4_25_bits():
    from megatron_gptoss.config import gpt_oss_20b, gpt_oss_120b

    for preset, expert_values, gib in ((gpt_oss_20b, 19.1e9, 12.8), (gpt_oss_120b, 114.7e9, 60.8)):
        config = preset(expert_format="mxfp4", lora=LORA)
        counts = config.param_counts()
        assert round(counts["expert_weights"] / 1e9, 1) == expert_values / 1e9
        other = counts["total"] - counts["expert_weights"]
        assert config.weight_bytes(2) == 2 * other + counts["expert_weights"] * 4.25 / 8
        assert round(config.weight_bytes(2) / 2**30, 1) == gib
        assert preset().weight_bytes(2) == 2 * counts["total"]  # bf16 experts: every value 2 bytes


def test_module_conversions_keep_the_bytes_and_move_the_dtype():
    packed, _ = _pair("loop")
    before = {n: w.blocks.clone() for n, w in mxfp4_weights(packed).items()}
    packed.to(torch.bfloat16)
    for name, weight in mxfp4_weights(packed).items():
        assert weight.blocks.dtype == torch.uint8 and torch.equal(weight.blocks, before[name])
        assert weight.dtype == torch.bfloat16 and weight.dequantize().dtype == torch.bfloat16
    experts = packed.decoder.layers["0"].mlp.experts
    assert experts.linear_fc1.dtype == experts.linear_fc1.bias.dtype == torch.bfloat16


@torch.no_grad()
def _same_adapters(model: GPTOSSModel, other: GPTOSSModel) -> None:
    """Random adapters (B nonzero) drawn into `model` and copied into `other` (the same architecture)."""
    for (name, p), q in zip(model.named_parameters(), other.parameters()):
        if is_adapter_param(name):
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
            q.copy_(p)


def test_pairs_byte_format_loads_computes_and_exports_as_the_released_bytes(tmp_path):
    """`model.mxfp4_byte_format: pairs`: a released-layout checkpoint loads into `pair_words`' re-encoding of
    its bytes (the same scales), the random initialisation likewise, and the model computes, and exports,
    exactly what the released bytes give; scales beyond the format's range and unknown formats are refused."""
    ref = reference_model(1, tiny_config())
    path = write_mxfp4_checkpoint(ref, tmp_path / "mxfp4")
    config = dataclasses.replace(ref.config, lora=LORA, expert_format="mxfp4")
    models = {
        fmt: GPTOSSModel(dataclasses.replace(config, mxfp4_byte_format=fmt))
        for fmt in ("checkpoint", "pairs")
    }
    for model in models.values():
        load_hf_parallel([model], path, ONE, model.config)
    plain, pairs = (mxfp4_weights(models[fmt]) for fmt in ("checkpoint", "pairs"))
    for name, weight in pairs.items():
        assert weight.byte_format == "pairs" and plain[name].byte_format == "checkpoint"
        assert torch.equal(weight.blocks, pair_words(plain[name].blocks)), name
        assert not torch.equal(weight.blocks, plain[name].blocks) and torch.equal(
            weight.scales, plain[name].scales
        )
        assert torch.equal(weight.dequantize(torch.float32), plain[name].dequantize(torch.float32)), name
    with torch.no_grad():
        _same_adapters(models["pairs"], models["checkpoint"])
        tokens = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
        assert torch.equal(models["pairs"](tokens), models["checkpoint"](tokens))
        exported = load_hf(save_hf(models["pairs"], tmp_path / "export", dtype=torch.float32))
        assert rel_err(exported(tokens), models["checkpoint"](tokens)) <= 1e-5
    init = GPTOSSModel(dataclasses.replace(config, mxfp4_byte_format="pairs"))
    init_parallel([init], init.config, ONE, seed=5)
    drawn = GPTOSSModel(config)
    init_parallel([drawn], config, ONE, seed=5)
    for name, weight in mxfp4_weights(init).items():
        assert torch.equal(weight.blocks, pair_words(mxfp4_weights(drawn)[name].blocks)), name
    weight = next(iter(pairs.values()))
    with pytest.raises(ValueError, match="decodes scale bytes 2..128 exactly; these experts' scales span"):
        weight.copy_packed_(plain[next(iter(plain))].blocks, torch.full_like(weight.scales, 129))
    with pytest.raises(ConfigError, match="model.mxfp4_byte_format='nibbles'"):
        dataclasses.replace(config, mxfp4_byte_format="nibbles")


def test_tiled_pairs_load_compute_and_export_as_the_released_bytes(tmp_path):
    """`model.mxfp4_byte_format: tiled_pairs`: a released-layout checkpoint loads into the pairs' bytes and
    the scales stored tile by tile (`tile_experts`), the random initialisation likewise, and the model
    computes, and exports, exactly what the released bytes give; widths that are not multiples of 64 are
    refused by the config and by the weight."""
    ref = reference_model(2, tiny_config(hidden_size=128, intermediate_size=128))
    path = write_mxfp4_checkpoint(ref, tmp_path / "mxfp4")
    config = dataclasses.replace(ref.config, lora=LORA, expert_format="mxfp4")
    tiled_config = dataclasses.replace(config, mxfp4_byte_format="tiled_pairs")
    plain_model, tiled_model = GPTOSSModel(config), GPTOSSModel(tiled_config)
    for model in (plain_model, tiled_model):
        load_hf_parallel([model], path, ONE, model.config)
    plain = mxfp4_weights(plain_model)
    for name, weight in mxfp4_weights(tiled_model).items():
        assert weight.byte_format == "tiled_pairs"
        assert torch.equal(weight.blocks, tile_experts(pair_words(plain[name].blocks))), name
        assert torch.equal(weight.scales, tile_experts(plain[name].scales)), name
        assert not torch.equal(weight.scales, plain[name].scales), name
        assert torch.equal(weight.dequantize(torch.float32), plain[name].dequantize(torch.float32)), name
    tokens = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _same_adapters(tiled_model, plain_model)
        out = tiled_model(tokens)
        assert out.isfinite().all() and torch.equal(out, plain_model(tokens))
        exported = load_hf(save_hf(tiled_model, tmp_path / "export", dtype=torch.float32))
        assert rel_err(exported(tokens), plain_model(tokens)) <= 1e-5
    init = GPTOSSModel(tiled_config)
    init_parallel([init], tiled_config, ONE, seed=5)
    drawn = GPTOSSModel(config)
    init_parallel([drawn], config, ONE, seed=5)
    for name, weight in mxfp4_weights(init).items():
        assert torch.equal(weight.dequantize(), mxfp4_weights(drawn)[name].dequantize()), name
    with pytest.raises(ConfigError, match="model.hidden_size=32 is not a multiple of 64"):
        dataclasses.replace(tiny_config(), mxfp4_byte_format="tiled_pairs")
    with pytest.raises(ValueError, match="out_features=96, not a multiple of 64"):
        MXFP4Weight(2, 96, 64, byte_format="tiled_pairs")
