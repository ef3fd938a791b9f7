"""HF checkpoint directories written the way the released gpt-oss checkpoints are."""

from __future__ import annotations

import json
import math

import torch
from safetensors.torch import save_file

from megatron_gptoss.hf import iter_hf_tensors, quantize_mxfp4
from megatron_gptoss.hf.mxfp4 import QUANTIZATION_CONFIG, packed_shapes
from megatron_gptoss.hf.names import hf_names, hf_shapes, match_hf


def released_blocks(
    gen: torch.Generator, lead: tuple[int, ...], scale_range: tuple[int, int] = (0, 252)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 (blocks [*lead, 16], scales [*lead]) with the released checkpoints' property: every
    block's largest magnitude is 4 or 6 times its scale (half the blocks each, their largest code at a random
    place with a random sign); scales uniform in `scale_range` (both ends included; at most 252, so values
    stay finite in float32 and bf16)."""
    count = math.prod(lead)
    nibbles = torch.randint(0, 16, (count, 32), generator=gen)
    top = torch.where(torch.arange(count) % 2 == 0, 7, 6)[:, None]  # 6.0 or 4.0
    nibbles = torch.where((nibbles & 7) > top, (nibbles & 8) | top, nibbles)
    place = torch.randint(0, 32, (count, 1), generator=gen)
    sign = torch.randint(0, 2, (count, 1), generator=gen) << 3
    nibbles.scatter_(1, place, top | sign)
    blocks = (nibbles[:, 0::2] | nibbles[:, 1::2] << 4).to(torch.uint8)
    low, high = scale_range
    scales = torch.randint(low, high + 1, (count,), dtype=torch.uint8, generator=gen)
    scales[0], scales[-1] = low, high
    return blocks.reshape(*lead, 16), scales.reshape(lead)


def write_released_checkpoint(config, path, seed: int = 0):
    """An HF directory in the released layout whose expert blocks all have the released property
    (`released_blocks`, scales 2 ** -10 .. 2 ** -4): MXFP4 experts (scales in a second shard), bf16 random
    weights elsewhere, the released `quantization_config`."""
    path.mkdir()
    gen = torch.Generator().manual_seed(seed)
    shards: dict[str, dict[str, torch.Tensor]] = {"model-00001-of-00002.safetensors": {}}
    shards["model-00002-of-00002.safetensors"] = {}
    first, second = list(shards)
    for name in hf_names(config):
        match = match_hf(name)
        assert match is not None
        shape = tuple(hf_shapes(match, config)[match.hf.index(name)])
        packed = packed_shapes(shape) if match.rule.kind in ("fc1", "fc2") else None
        if packed is not None:
            blocks, scales = released_blocks(gen, packed[1], scale_range=(117, 123))
            shards[first][name + "_blocks"], shards[second][name + "_scales"] = blocks, scales
        else:
            shards[first][name] = (0.05 * torch.randn(shape, generator=gen)).to(torch.bfloat16)
    weight_map = {}
    for file, tensors in shards.items():
        save_file(tensors, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    hf_config = config.to_hf_config()
    hf_config["quantization_config"] = json.loads(json.dumps(QUANTIZATION_CONFIG))
    (path / "config.json").write_text(json.dumps(hf_config))
    return path


def write_mxfp4_checkpoint(model, path, scales_apart: bool = False):
    """An HF directory as the released checkpoints are: expert weights as MXFP4 blocks/scales (quantized
    along their input dimension), everything else bf16. With `scales_apart`, every `_scales` tensor is
    in a second shard, away from its blocks."""
    path.mkdir()
    shards: dict[str, dict[str, torch.Tensor]] = {"model-00001-of-00002.safetensors": {}}
    shards["model-00002-of-00002.safetensors"] = {}
    first, second = list(shards)
    for name, tensor in iter_hf_tensors(model, model.config):
        if name.endswith(("gate_up_proj", "down_proj")):
            blocks, scales = quantize_mxfp4(tensor.transpose(1, 2))
            shards[first][name + "_blocks"] = blocks.contiguous()
            shards[second if scales_apart else first][name + "_scales"] = scales.contiguous()
        else:
            shards[first][name] = tensor.to(torch.bfloat16).contiguous()
    weight_map = {}
    for file, tensors in shards.items():
        save_file(tensors, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = model.config.to_hf_config()
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn"],
    }
    (path / "config.json").write_text(json.dumps(config))
    return path
