"""MXFP4 expert weights: our dequantization against transformers', and MXFP4 checkpoint import.

transformers dequantizes MXFP4 checkpoints on the CPU when given `Mxfp4Config(dequantize=True)`:
its loader feeds `<name>_blocks` / `<name>_scales` to `convert_moe_packed_tensors`, whose result is
already in GptOssExperts' orientation (gate_up_proj [E, H, 2I], down_proj [E, I, H]) and is loaded
as is. The import tests therefore compare our `load_hf` with transformers' own `from_pretrained` of the
same directory, parameter by parameter and on logits.
"""

import json

import pytest
import torch
from helpers.hf_checkpoints import write_mxfp4_checkpoint
from helpers.hf_reference import hf_twin, rel_err
from safetensors.torch import save_file

from megatron_gptoss.config import gpt_oss_tiny
from megatron_gptoss.errors import CheckpointError
from megatron_gptoss.hf import (
    dequantize_mxfp4,
    iter_hf_tensors,
    load_hf,
    quantize_mxfp4,
)
from megatron_gptoss.hf.mxfp4 import unpack_expert_weight
from megatron_gptoss.model import build_model

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def random_packed(gen, lead=(3, 40), groups=4, low=0, high=255):
    blocks = torch.randint(0, 256, (*lead, groups, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(low, high, (*lead, groups), dtype=torch.uint8, generator=gen)
    return blocks, scales


@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_equals_transformers_bitwise(dtype):
    """Every byte value and every finite scale (0..254, i.e. 2**-127 .. 2**127)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks, scales = random_packed(gen)
    blocks[0, 0, 0] = torch.arange(16, dtype=torch.uint8) * 17  # bytes 0x00 .. 0xFF with equal nibbles
    reference = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    ours = unpack_expert_weight(blocks, scales, dtype)
    assert ours.dtype == reference.dtype == dtype and ours.shape == reference.shape == (3, 128, 40)
    assert torch.equal(ours, reference)
    assert torch.equal(dequantize_mxfp4(blocks, scales, dtype), reference.transpose(1, 2))


def test_nibble_order_values_and_scale():
    blocks = torch.zeros(1, 16, dtype=torch.uint8)
    blocks[0, 0] = 0x21  # low nibble 1 (0.5), high nibble 2 (1.0)
    blocks[0, 1] = 0xF8  # low nibble 8 (-0.0), high nibble 15 (-6.0)
    blocks[0, 2] = 0x7B  # low nibble 11 (-1.5), high nibble 7 (6.0)
    values = dequantize_mxfp4(blocks, torch.tensor([128], dtype=torch.uint8), torch.float32)
    assert values.shape == (32,)
    assert values[:6].tolist() == [1.0, 2.0, -0.0, -12.0, -3.0, 12.0]
    assert torch.signbit(values[2]) and not values[6:].any()
    tiny = dequantize_mxfp4(blocks, torch.tensor([0], dtype=torch.uint8), torch.float32)
    assert tiny[1].item() == 2.0**-127


def test_quantize_round_trips_grid_values_and_bounds_error():
    gen = torch.Generator().manual_seed(1)
    blocks, scales = random_packed(gen, low=100, high=150)
    grid = dequantize_mxfp4(blocks, scales, torch.float32)
    again = dequantize_mxfp4(*quantize_mxfp4(grid), torch.float32)
    assert torch.equal(again, grid)

    x = torch.randn(16, 256, generator=gen)
    b, s = quantize_mxfp4(x)
    assert b.shape == (16, 8, 16) and s.shape == (16, 8) and b.dtype == s.dtype == torch.uint8
    y = dequantize_mxfp4(b, s, torch.float32)
    err = rel_err(y, x)
    assert 0.05 < err < 0.15, err  # e2m1 keeps two significant bits
    assert (y.abs().reshape(-1, 32).amax(-1) <= 6 * torch.exp2(s.float().reshape(-1) - 127)).all()


def test_shape_and_dtype_errors():
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(
            torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8), torch.float32
        )
    with pytest.raises(TypeError, match="uint8"):
        dequantize_mxfp4(torch.zeros(2, 16), torch.zeros(2, dtype=torch.uint8), torch.float32)
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_mxfp4(torch.zeros(4, 48))


# ------------------------------------------------------------------------------------------------
# MXFP4 checkpoint directories
def transformers_load(path):
    from transformers import GptOssForCausalLM, Mxfp4Config

    quantization = Mxfp4Config(dequantize=True)
    model = GptOssForCausalLM.from_pretrained(path, dtype=torch.float32, quantization_config=quantization)
    return model.eval()


def tiny_model(seed=0):
    model = build_model(gpt_oss_tiny(attention_backend="eager"), seed=seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + 1)))
    return model


@pytest.mark.parametrize("scales_apart", [False, True])
def test_mxfp4_checkpoint_loads_as_transformers_loads_it(tmp_path, scales_apart):
    path = write_mxfp4_checkpoint(tiny_model(), tmp_path / "mxfp4", scales_apart)
    ours = load_hf(path, make_vocab_size_divisible_by=32, attention_backend="eager")
    reference = transformers_load(path)
    ref_params = dict(reference.named_parameters())
    ours_params = dict(iter_hf_tensors(ours, ours.config))
    assert set(ours_params) == set(ref_params)
    for name, tensor in ours_params.items():
        assert torch.equal(tensor, ref_params[name]), name
    # Logits against transformers' plain fp32 model with the same weights: the model transformers
    # builds for an MXFP4 checkpoint computes its experts in its own precision (bf16 in some releases).
    tokens = torch.randint(0, ours.config.vocab_size, (2, 21), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        err = rel_err(ours(tokens), hf_twin(ours)(tokens).logits)
    assert err <= 1e-6, err


def test_mxfp4_checkpoint_in_bf16(tmp_path):
    """Dequantized MXFP4 values are exact in bf16: a bf16 load equals the fp32 load cast to bf16."""
    path = write_mxfp4_checkpoint(tiny_model(), tmp_path / "mxfp4")
    fp32 = load_hf(path, make_vocab_size_divisible_by=32)
    bf16 = load_hf(path, dtype=torch.bfloat16, make_vocab_size_divisible_by=32)
    for (name, a), (_, b) in zip(fp32.named_parameters(), bf16.named_parameters()):
        assert b.dtype == torch.bfloat16 and torch.equal(a.to(torch.bfloat16), b), name


def rewrite(path, change):
    """Apply `change(tensors)` to the first shard of an MXFP4 directory (index kept consistent)."""
    from safetensors.torch import load_file

    file = path / "model-00001-of-00002.safetensors"
    tensors = load_file(str(file))
    change(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if f != file.name}
    index["weight_map"].update(dict.fromkeys(tensors, file.name))
    index_file.write_text(json.dumps(index))


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda t: t.pop("model.layers.1.mlp.experts.down_proj_scales"), "down_proj_scales"),
        (lambda t: t.pop("model.layers.0.mlp.experts.gate_up_proj_blocks"), "gate_up_proj_blocks"),
        (
            lambda t: t.update(
                {"model.layers.0.mlp.experts.down_proj_blocks": torch.zeros(4, 32, 2, 16).byte()}
            ),
            r"down_proj_blocks'.*\(4, 32, 2, 16\).*\(4, 32, 1, 16\)",
        ),
        (
            lambda t: t.update({"model.layers.0.mlp.experts.down_proj_scales": torch.zeros(4, 32, 1)}),
            "down_proj_scales'.*dtype",
        ),
        (
            lambda t: t.update({"model.layers.0.mlp.router.weight_blocks": torch.zeros(1).byte()}),
            "weight_blocks",
        ),
    ],
    ids=["missing_scales", "missing_blocks", "blocks_shape", "scales_dtype", "unexpected_blocks"],
)
def test_corrupted_mxfp4_checkpoint_names_the_tensor(tmp_path, change, message):
    path = write_mxfp4_checkpoint(tiny_model(), tmp_path / "mxfp4")
    rewrite(path, change)
    with pytest.raises(CheckpointError, match=message):
        load_hf(path, make_vocab_size_divisible_by=32)
