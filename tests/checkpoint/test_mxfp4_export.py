"""MXFP4 export (`tools/convert_dist_to_hf.py --experts mxfp4`): the released layout back, byte for byte.

A directory in the released layout (every expert block's largest magnitude 4 or 6 times its scale, as the
released checkpoints' are) -> a sharded checkpoint of an ep2 x tp2 layout (bf16: MXFP4 values are exact in
it) -> HF with `--experts mxfp4`: every tensor (blocks, scales, bf16 weights) equals the source's bytes, the
config carries the released `quantization_config`, and transformers loads it as it loads the source (on a
CPU its MXFP4 loader dequantizes, the path it takes without the `kernels` package or a GPU).
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers.hf_checkpoints import write_released_checkpoint
from helpers.scripts import load_script, read_tensors

from megatron_gptoss.config import gpt_oss_tiny
from megatron_gptoss.hf.io import save_hf_tensors
from megatron_gptoss.hf.mxfp4 import QUANTIZATION_CONFIG, pack_expert_weight, unpack_expert_weight


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The released-layout source, its ep2 x tp2 sharded checkpoint, and that exported with --experts mxfp4
    (small shards and blocks, so blocks and scales of a weight fall in different shards) and with the
    default."""
    root = tmp_path_factory.mktemp("mxfp4_export")
    write_released_checkpoint(gpt_oss_tiny(), root / "released", seed=5)
    args = [str(root / "released"), str(root / "dist"), "--world", "4", "--tp", "2", "--ep", "2"]
    load_script("convert_hf_to_dist").main([*args, "--make-vocab-size-divisible-by", "32", "--no-progress"])
    small = ["--shard-gb", str(20_000 / 2**30), "--block-mb", "0", "--no-progress"]
    back = load_script("convert_dist_to_hf").main(
        [str(root / "dist"), str(root / "mxfp4"), *small, "--experts", "mxfp4"]
    )
    load_script("convert_dist_to_hf").main([str(root / "dist"), str(root / "bf16"), "--no-progress"])
    assert len(list((root / "mxfp4").glob("*.safetensors"))) > 2 and back["bytes_written"] > 0
    return root


def test_mxfp4_export_gives_the_released_bytes_back(exported):
    source, back = read_tensors(exported / "released"), read_tensors(exported / "mxfp4")
    assert sorted(back) == sorted(source)
    packed = [name for name in source if name.endswith(("_blocks", "_scales"))]
    assert len(packed) == 2 * 2 * gpt_oss_tiny().num_layers
    for name, tensor in source.items():
        assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape, name
        assert torch.equal(back[name].view(torch.uint8), tensor.view(torch.uint8)), name
    index = json.loads((exported / "mxfp4" / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(source)
    config = json.loads((exported / "mxfp4" / "config.json").read_text())
    assert config["quantization_config"] == json.loads(json.dumps(QUANTIZATION_CONFIG))
    released = json.loads((exported / "released" / "config.json").read_text())
    assert config["quantization_config"] == released["quantization_config"]


def test_default_export_writes_the_dequantized_experts_in_bf16(exported):
    source, dense = read_tensors(exported / "released"), read_tensors(exported / "bf16")
    name = "model.layers.1.mlp.experts.gate_up_proj"
    expected = unpack_expert_weight(source[name + "_blocks"], source[name + "_scales"], torch.bfloat16)
    assert name + "_blocks" not in dense and torch.equal(dense[name], expected)
    assert "quantization_config" not in json.loads((exported / "bf16" / "config.json").read_text())


def test_transformers_loads_the_export_as_it_loads_the_release(exported):
    from transformers import AutoConfig, GptOssForCausalLM

    assert AutoConfig.from_pretrained(exported / "mxfp4").quantization_config["quant_method"] == "mxfp4"
    theirs = {}
    for name in ("released", "mxfp4"):
        model = GptOssForCausalLM.from_pretrained(exported / name, dtype=torch.float32)
        theirs[name] = dict(model.named_parameters())
    source = read_tensors(exported / "released")
    for name, tensor in theirs["mxfp4"].items():
        assert torch.equal(tensor, theirs["released"][name]), name
    experts = "model.layers.0.mlp.experts.down_proj"
    expected = unpack_expert_weight(source[experts + "_blocks"], source[experts + "_scales"], torch.float32)
    assert torch.equal(theirs["mxfp4"][experts].float(), expected)


def test_save_hf_tensors_quantizes_merged_experts(tmp_path):
    """The merged-LoRA export's writer (`save_hf_tensors`, experts="mxfp4"): float experts quantized by the
    rule, everything else in the export dtype."""
    gen = torch.Generator().manual_seed(0)
    gate_up = torch.randn(4, 64, 32, generator=gen)  # [E, H, 2I], not on any MXFP4 grid
    bias = torch.randn(4, 32, generator=gen)
    pairs = [("model.layers.0.mlp.experts.gate_up_proj", gate_up), ("model.norm.weight", torch.ones(64))]
    pairs.append(("model.layers.0.mlp.experts.gate_up_proj_bias", bias))
    config = gpt_oss_tiny()
    save_hf_tensors(iter(pairs), config, tmp_path / "out", experts="mxfp4")
    written = read_tensors(tmp_path / "out")
    blocks, scales = pack_expert_weight(gate_up)
    assert torch.equal(written["model.layers.0.mlp.experts.gate_up_proj_blocks"], blocks)
    assert torch.equal(written["model.layers.0.mlp.experts.gate_up_proj_scales"], scales)
    assert written["model.norm.weight"].dtype == torch.bfloat16
    assert torch.equal(written["model.layers.0.mlp.experts.gate_up_proj_bias"], bias.bfloat16())
    config_json = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config_json["quantization_config"]["quant_method"] == "mxfp4"
    with pytest.raises(ValueError, match="experts='fp8'"):
        save_hf_tensors(iter(pairs), config, tmp_path / "bad", experts="fp8")
