"""The MXFP4 quantization rule (`hf.mxfp4.quantize_mxfp4`): scale, rounding, ties, signed zeros, and the
round trips the export and the weight sync rely on.

    released blocks (largest magnitude 4 or 6 times the scale)   quantize(dequantize(b, s)) == (b, s)
    any other finite block                                       dequantize(quantize(v)) == v, bit for bit
"""

import math

import pytest
import torch
from helpers.hf_checkpoints import released_blocks, write_mxfp4_checkpoint
from safetensors import safe_open

from megatron_gptoss.config import gpt_oss_tiny
from megatron_gptoss.hf.mxfp4 import (
    FP4_MAGNITUDES,
    dequantize_mxfp4,
    fp4_codes,
    pack_expert_weight,
    quantize_mxfp4,
    scale_bytes,
    unpack_expert_weight,
)
from megatron_gptoss.model import build_model

DTYPES = [torch.float32, torch.bfloat16]


def bits(values: torch.Tensor) -> torch.Tensor:
    """The values' float32 bit patterns (tells -0.0 from 0.0)."""
    return values.float().view(torch.int32)


def block_max_in_scales(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[..., G] largest FP4 magnitude of each block (the block's largest magnitude over its scale)."""
    magnitudes = torch.tensor(FP4_MAGNITUDES)
    nibbles = torch.stack([blocks & 7, (blocks >> 4) & 7], dim=-1).long()
    return magnitudes[nibbles].flatten(-2).amax(-1)


def other_blocks(gen: torch.Generator, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks whose largest magnitude is at most 3 times their scale (codes 0..5 with signs), random scales
    0..252, the first ones all +0 and all -0."""
    nibbles = (
        torch.randint(0, 6, (count, 32), generator=gen) | torch.randint(0, 2, (count, 32), generator=gen) << 3
    )
    nibbles[0], nibbles[1] = 0, 8
    blocks = (nibbles[:, 0::2] | nibbles[:, 1::2] << 4).to(torch.uint8)
    return blocks, torch.randint(0, 253, (count,), dtype=torch.uint8, generator=gen)


@pytest.mark.parametrize("dtype", DTYPES)
def test_released_blocks_come_back_byte_for_byte(dtype):
    """Every byte value, scales 0..252 (finite in float32 and bf16 after scaling by 6), signed zeros."""
    blocks, scales = released_blocks(torch.Generator().manual_seed(0), (4096,))
    assert set(blocks.unique().tolist()) == set(range(256))
    assert int(scales.min()) == 0 and int(scales.max()) == 252
    top = block_max_in_scales(blocks, scales)
    assert ((top == 4) | (top == 6)).all() and (top == 4).any() and (top == 6).any()
    negative_zeros = ((blocks & 0x0F) == 8).sum() + ((blocks >> 4) == 8).sum()
    assert negative_zeros > 1000
    again_blocks, again_scales = quantize_mxfp4(dequantize_mxfp4(blocks, scales, dtype))
    assert torch.equal(again_scales, scales)
    assert torch.equal(again_blocks, blocks)


@pytest.mark.parametrize("dtype", DTYPES)
def test_other_blocks_come_back_with_the_same_values(dtype):
    gen = torch.Generator().manual_seed(1)
    blocks, scales = other_blocks(gen, 4096)
    values = dequantize_mxfp4(blocks, scales, dtype)
    again_blocks, again_scales = quantize_mxfp4(values)
    assert torch.equal(bits(dequantize_mxfp4(again_blocks, again_scales, dtype)), bits(values))
    # The all +0 and all -0 blocks: the smallest scale, their signs kept.
    assert again_scales[:2].tolist() == [0, 0]
    assert (again_blocks[0] == 0x00).all() and (again_blocks[1] == 0x88).all()
    # Their bytes may differ (a smaller scale where the largest code is below 4): most do here.
    assert not torch.equal(again_scales, scales)


def test_test_checkpoint_blocks_round_trip(tmp_path):
    """The blocks of the MXFP4 test checkpoints (`write_mxfp4_checkpoint`, quantized from a random model):
    the same values always, the same bytes where the block's largest magnitude is 4 or 6 times its scale."""
    path = write_mxfp4_checkpoint(build_model(gpt_oss_tiny(), seed=0), tmp_path / "mxfp4")
    seen = 0
    with safe_open(str(path / "model-00001-of-00002.safetensors"), framework="pt") as handle:
        for name in [n for n in handle.keys() if n.endswith("_blocks")]:
            blocks, scales = handle.get_tensor(name), handle.get_tensor(name.replace("_blocks", "_scales"))
            values = dequantize_mxfp4(blocks, scales, torch.bfloat16)
            again_blocks, again_scales = quantize_mxfp4(values)
            assert torch.equal(
                bits(dequantize_mxfp4(again_blocks, again_scales, torch.bfloat16)), bits(values)
            )
            top = block_max_in_scales(blocks, scales)
            released = (top == 4) | (top == 6)
            assert torch.equal(again_blocks[released], blocks[released]), name
            assert torch.equal(again_scales[released], scales[released]), name
            seen += int(released.sum())
    assert seen > 100


def test_scale_is_the_smallest_power_of_two_bringing_the_largest_magnitude_to_six():
    """Against the definition, evaluated in float64, at the boundaries 4, 6 and 8 times every power of two,
    one float32 step either side of them, random magnitudes, subnormals, zero and float32's largest."""
    powers = torch.exp2(torch.arange(-126, 125, dtype=torch.float64))  # 8 * 2 ** 125 is inf
    edges = torch.cat([powers * 4, powers * 6, powers * 8]).float()
    near = torch.cat([edges, torch.nextafter(edges, edges * 2), torch.nextafter(edges, edges * 0)])
    gen = torch.Generator().manual_seed(2)
    random = torch.exp2(torch.empty(20000).uniform_(-140, 127, generator=gen)).float()
    extremes = torch.tensor([0.0, 2.0**-149, 2.0**-127, 3 * 2.0**-126, torch.finfo(torch.float32).max])
    amax = torch.cat([near, random, extremes])
    ours = scale_bytes(amax).long()
    exact = amax.double()
    fits = exact[:, None] <= 6 * torch.exp2(torch.arange(255, dtype=torch.float64) - 127)[None, :]
    assert torch.equal(ours, fits.int().argmax(dim=1))  # first byte that fits
    # The OCP specification's floor(log2(amax)) - 2 agrees where the largest magnitude is 4 or 6 times the
    # scale and takes half our scale where amax / 2 ** floor(log2(amax)) is in (1.5, 2).
    normal = amax >= 2.0**-120
    mantissa, exponent = torch.frexp(amax[normal])
    ocp = (exponent - 1 - 2 + 127).long()
    ratio = mantissa * 2
    assert torch.equal(ours[normal][ratio <= 1.5], ocp[ratio <= 1.5])
    assert torch.equal(ours[normal][ratio > 1.5], ocp[ratio > 1.5] + 1)


def test_values_round_to_the_nearest_code_ties_away_from_zero():
    midpoints = [(a + b) / 2 for a, b in zip(FP4_MAGNITUDES, FP4_MAGNITUDES[1:])]
    ties = torch.tensor(midpoints)
    assert fp4_codes(ties).tolist() == [1, 2, 3, 4, 5, 6, 7]  # to the larger magnitude
    assert fp4_codes(-ties).tolist() == [9, 10, 11, 12, 13, 14, 15]
    below = torch.nextafter(ties, torch.zeros_like(ties))
    above = torch.nextafter(ties, torch.full_like(ties, 7.0))
    assert fp4_codes(below).tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert fp4_codes(above).tolist() == [1, 2, 3, 4, 5, 6, 7]
    # Signed zeros and negative values that round to zero keep the sign bit.
    assert fp4_codes(torch.tensor([0.0, -0.0, -0.1, 0.1, 6.0, -6.0])).tolist() == [0, 8, 8, 0, 7, 15]


def test_random_values_go_to_their_nearest_grid_point_without_saturating():
    """Gaussian blocks of spread magnitudes: each value's dequantized result is the nearest point of its
    block's grid (float64 brute force, ties up), and the grid's largest point is at least the block's
    largest magnitude."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(512, 32, generator=gen) * torch.exp2(torch.randint(-20, 20, (512, 1), generator=gen))
    x[0] = 0.0
    x[0, :5] = torch.tensor([3.5, -5.0, 0.25, -0.75, 6.0]) * 2.0**-3  # ties at the block's scale (2 ** -3)
    blocks, scales = quantize_mxfp4(x)
    y = dequantize_mxfp4(blocks, scales, torch.float32).double()  # [512, 32]
    scale = torch.exp2(scales.reshape(-1).double() - 127)[:, None]
    grid = torch.tensor(FP4_MAGNITUDES, dtype=torch.float64)
    assert (x.abs().amax(-1, keepdim=True) <= 6 * scale).all()
    distance = (x.double().abs()[..., None] - grid * scale[..., None]).abs()
    nearest = grid.flip(0)[distance.flip(-1).argmin(dim=-1)] * scale  # first minimum: ties go up
    assert torch.equal(y.abs(), nearest)
    assert torch.equal(torch.signbit(y), torch.signbit(x))
    assert y[0, :5].tolist() == [0.5, -0.75, 2.0**-4, -0.125, 0.75]


def test_pack_is_the_inverse_of_unpack_and_errors_are_named():
    blocks, scales = released_blocks(torch.Generator().manual_seed(4), (3, 8, 2))
    weight = unpack_expert_weight(blocks, scales, torch.bfloat16)  # [E, in, out]
    assert weight.shape == (3, 64, 8)
    again = pack_expert_weight(weight)
    assert torch.equal(again[0], blocks) and torch.equal(again[1], scales)
    with pytest.raises(ValueError, match="non-finite"):
        quantize_mxfp4(torch.tensor([math.nan] + [0.0] * 31))
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_mxfp4(torch.zeros(2, 40))
    with pytest.raises(ValueError, match=r"\[E, in, out\]"):
        pack_expert_weight(torch.zeros(4, 64))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_on_cuda_equals_the_cpu(dtype):
    """The weight sync quantizes on the learner's device: the same bytes as on the CPU, at gpt-oss-20b's
    fc1 width, with released blocks, ties, signed zeros and an all-zero block among them."""
    gen = torch.Generator().manual_seed(5)
    x = (0.02 * torch.randn(4, 5760, 2880, generator=gen)).to(dtype)
    blocks, scales = released_blocks(gen, (90,))
    x[0, 0] = dequantize_mxfp4(blocks, scales, dtype)
    x[0, 1, :64] = torch.tensor([0.25, -0.75, 1.25, -1.75, 2.5, -3.5, 5.0, -0.0] * 4 + [6.0] + [0.0] * 31)
    x[0, 2, :32] = -0.0
    cpu = quantize_mxfp4(x)
    cuda = quantize_mxfp4(x.cuda())
    assert cuda[0].is_cuda and torch.equal(cuda[0].cpu(), cpu[0]) and torch.equal(cuda[1].cpu(), cpu[1])
