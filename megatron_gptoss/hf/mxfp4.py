"""MXFP4: the 4-bit expert-weight format of the released GPT-OSS checkpoints.

A row of K values is cut into K / 32 blocks. Each block stores
    32 FP4 (e2m1) codes, two per byte, the low nibble first: 16 bytes  -> `blocks` [..., K / 32, 16] uint8
    one shared power-of-two scale, a biased exponent (E8M0, bias 127) -> `scales` [..., K / 32] uint8
and value j of block g is fp4(code_j) * 2 ** (scales[g] - 127).

An FP4 code is 1 sign bit (bit 3), 2 exponent bits and 1 mantissa bit:
    code & 7 :  0    1    2    3    4    5    6    7
    value    :  0   0.5  1.0  1.5  2.0  3.0  4.0  6.0

Every decoded value is exact in float32 and bfloat16 (at most two significant bits times a power of
two within their exponent range), so dequantization is exact in those dtypes.

Checkpoint orientation: the HF expert tensors `gate_up_proj` [E, H, 2I] and `down_proj` [E, I, H]
are stored quantized along their input dimension, as `<name>_blocks` [E, out, in / 32, 16] and
`<name>_scales` [E, out, in / 32]; `unpack_expert_weight` returns the HF orientation [E, in, out] and
`pack_expert_weight` stores it back.

Quantization (`quantize_mxfp4`): per block, the smallest power-of-two scale that brings the largest
magnitude to at most 6 (nothing saturates), then round to the nearest code, ties away from zero, the sign
kept (-0.0 is code 8). Blocks whose largest magnitude is 4 or 6 times their scale (every released block)
come back byte for byte; any other block comes back with the same values (`scale_bytes` says why this scale
rule and not the OCP specification's).
"""

from __future__ import annotations

import torch

BLOCK = 32
BLOCK_BYTES = BLOCK // 2
SCALE_BIAS = 127

# The `quantization_config` of the released checkpoints' config.json: experts MXFP4, these modules bf16.
# transformers (`Mxfp4Config`) and vLLM read a directory carrying it as an MXFP4 checkpoint.
QUANTIZATION_CONFIG = {
    "modules_to_not_convert": (
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ),
    "quant_method": "mxfp4",
}

# Magnitudes of the FP4 codes 0..7 (codes 8..15 are their negatives).
FP4_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# Halfway points between consecutive FP4 magnitudes (a value at one rounds up: `fp4_codes`).
_MIDPOINTS = tuple((a + b) / 2 for a, b in zip(FP4_MAGNITUDES, FP4_MAGNITUDES[1:]))

# Blocks decoded or encoded at once: bounds the temporaries to a few tens of MB whatever the tensor size.
_CHUNK_BLOCKS = 1 << 18


def _fp4_values() -> torch.Tensor:
    """[16] float32: the value of each FP4 code."""
    magnitudes = torch.tensor(FP4_MAGNITUDES, dtype=torch.float32)
    return torch.cat([magnitudes, -magnitudes])


def _byte_table() -> torch.Tensor:
    """[256, 2] float32: the two values a byte holds, low nibble first."""
    values = _fp4_values()
    codes = torch.arange(256)
    return torch.stack([values[codes & 0x0F], values[codes >> 4]], dim=-1)


def _power_of_two(scales: torch.Tensor) -> torch.Tensor:
    """2 ** (scales - 127) in float32, exactly: the scale byte is the float32 exponent field
    (byte 0 gives the subnormal 2 ** -127, byte 255 gives inf)."""
    bits = (scales.to(torch.int32) << 23).view(torch.float32)
    return torch.where(scales == 0, torch.tensor(2.0**-127), bits)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks [..., G, 16] uint8 and scales [..., G] uint8 -> values [..., G * 32] in `dtype`.

    Value 2j of a block comes from the low nibble of byte j, value 2j + 1 from its high nibble.
    Decoding runs in chunks of blocks, so temporaries stay small next to the result."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK_BYTES or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match: "
            f"blocks must be scales' shape + ({BLOCK_BYTES},)"
        )
    *lead, groups = scales.shape
    flat_blocks = blocks.reshape(-1, BLOCK_BYTES)
    flat_scales = scales.reshape(-1)
    table = _byte_table().to(blocks.device)
    out = torch.empty(flat_blocks.shape[0], BLOCK, dtype=dtype, device=blocks.device)
    for start in range(0, flat_blocks.shape[0], _CHUNK_BLOCKS):
        stop = start + _CHUNK_BLOCKS
        values = table[flat_blocks[start:stop].long()].reshape(-1, BLOCK)
        out[start:stop] = values * _power_of_two(flat_scales[start:stop]).unsqueeze(-1)
    return out.reshape(*lead, groups * BLOCK)


def quantize_mxfp4(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """values [..., K] (K a multiple of 32, any float dtype, finite) -> (blocks [..., K / 32, 16] uint8,
    scales [..., K / 32] uint8) on the values' device, by the rule below (`scale_bytes`, `fp4_codes`).

    Scale: the smallest power of two 2 ** (s - 127), s in 0..254, that brings the block's largest
    magnitude to at most 6 (an all-zero block gets s = 0). Codes: each value divided by the scale
    (exact: a power of two) is rounded to the nearest FP4 magnitude, ties to the larger magnitude (away
    from zero); the sign bit is the value's, so -0.0 (and a negative value that rounds to 0) is code 8.

    Round trips (tests/hf/test_mxfp4_rule.py): for every block whose largest magnitude is 4 or 6 times its
    scale, as every block of the released checkpoints is, quantize(dequantize(b, s)) gives b and s back
    byte for byte, signed zeros included; for any other finite block it gives back the same values (the
    scale then shrinks to the smallest that holds them, and the codes follow).

    Raises ValueError for a last dimension that is not a multiple of 32 or a non-finite value."""
    if values.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 needs a last dimension divisible by {BLOCK}, got {values.shape[-1]}")
    *lead, width = values.shape
    flat = values.detach().reshape(-1, BLOCK)
    blocks = torch.empty(flat.shape[0], BLOCK_BYTES, dtype=torch.uint8, device=values.device)
    scales = torch.empty(flat.shape[0], dtype=torch.uint8, device=values.device)
    for start in range(0, flat.shape[0], _CHUNK_BLOCKS):
        stop = start + _CHUNK_BLOCKS
        x = flat[start:stop].float().contiguous()
        amax = x.abs().amax(dim=-1)  # NaN or inf wherever the block holds one
        if not bool(torch.isfinite(amax).all()):
            raise ValueError("MXFP4 quantization of a non-finite value (NaN or inf)")
        scales[start:stop] = scale_bytes(amax)
        codes = fp4_codes(x / _power_of_two(scales[start:stop]).unsqueeze(-1))
        blocks[start:stop] = codes[:, 0::2] | codes[:, 1::2] << 4
    groups = width // BLOCK
    return blocks.reshape(*lead, groups, BLOCK_BYTES), scales.reshape(*lead, groups)


def scale_bytes(amax: torch.Tensor) -> torch.Tensor:
    """E8M0 scale byte of blocks with largest magnitudes `amax` (float32, finite, >= 0): the smallest s in
    0..254 with amax <= 6 * 2 ** (s - 127).

    Read from amax's float32 bits, exactly (no division, no logarithm): amax = (1 + m) * 2 ** (e - 127)
    needs 2 ** (e - 129) when m <= 1/2 (amax / 2 ** (e - 129) = 4 (1 + m) <= 6), else 2 ** (e - 128);
    below byte 0 (amax < 3 * 2 ** -126, zero and subnormals) it is byte 0. Float32's largest value is
    below 6 * 2 ** 127, so the byte never exceeds 254 (255 is E8M0's NaN).

    Why this rule and not the OCP MX specification's 2 ** (floor(log2(amax)) - 2): the two agree on
    every block whose largest magnitude is 4 or 6 times its scale (the released blocks: floor(log2(4s)) - 2
    and floor(log2(6s)) - 2 are both log2(s), and 4s, 6s <= 6s), so both give the released bytes back.
    They differ on blocks with amax / 2 ** floor(log2(amax)) in (1.5, 2): the specification's scale puts
    the largest values in (6, 8) and saturates them to 6 (up to 25% off on the block's largest weights);
    this one takes the next power of two, so nothing saturates: every value goes to its nearest code (the
    largest at most 1/5 off, as 5 -> 4 or 6; clamped from just below 8 to 6 is 1/4 off), at the price of a
    step twice as coarse for the block's small values.
    It is the scale triton_kernels' downcast_to_mxfp computes by default (DequantScaleRoundingMode.ROUND_UP,
    2 ** ceil(log2(amax / 6))), here exact where a float32 division by 6 rounds."""
    bits = amax.float().contiguous().view(torch.int32)
    above_half = ((bits & 0x7FFFFF) > 0x400000).to(torch.int32)
    return ((bits >> 23) - 2 + above_half).clamp(min=0).to(torch.uint8)


def fp4_codes(scaled: torch.Tensor) -> torch.Tensor:
    """FP4 codes (uint8, 0..15) of values already divided by their block's scale (float32, |x| <= 6 for
    the nearest code to be within half a step): the nearest magnitude, ties to the larger one (0.25 -> 0.5,
    0.75 -> 1, 1.25 -> 1.5, 1.75 -> 2, 2.5 -> 3, 3.5 -> 4, 5 -> 6, as triton_kernels' e2m1 conversion
    rounds), larger magnitudes to 6; bit 3 is the sign bit, so -0.0 gives code 8.

    The code is a function of the value's top 16 float32 bits (sign, exponent, 7 mantissa bits): every
    midpoint has at most 2 significant bits, so truncating the lower mantissa bits keeps a value on its side
    of each midpoint (and on it). One gather from a 65,536-entry table (`_code_table`, built from the
    midpoints) gives it."""
    index = (scaled.float().contiguous().view(torch.int32) >> 16) & 0xFFFF
    return torch.index_select(_code_table(scaled.device), 0, index.reshape(-1)).reshape(scaled.shape)


_CODE_TABLES: dict[torch.device, torch.Tensor] = {}


def _code_table(device: torch.device) -> torch.Tensor:
    """[65536] uint8: the FP4 code of the float32 whose top 16 bits are the index (lower bits zero), by
    counting the midpoints at or below its magnitude."""
    if device not in _CODE_TABLES:
        values = (torch.arange(1 << 16, dtype=torch.int32) << 16).view(torch.float32)
        midpoints = torch.tensor(_MIDPOINTS, dtype=torch.float32)
        codes = (values.abs().unsqueeze(-1) >= midpoints).sum(-1).to(torch.uint8)  # NaN: 0, never looked up
        _CODE_TABLES[device] = (codes | torch.signbit(values).to(torch.uint8) << 3).to(device)
    return _CODE_TABLES[device]


def unpack_expert_weight(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A checkpoint's `<name>_blocks` [E, out, in / 32, 16] and `<name>_scales` [E, out, in / 32] -> the
    HF expert weight [E, in, out] in `dtype` (a transposed view of the dequantized [E, out, in])."""
    if blocks.dim() != 4:
        raise ValueError(f"MXFP4 expert blocks must be [E, out, in / 32, 16], got {tuple(blocks.shape)}")
    return dequantize_mxfp4(blocks, scales, dtype).transpose(1, 2)


def pack_expert_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `unpack_expert_weight`: an HF expert weight [E, in, out] (any float dtype) ->
    (`<name>_blocks` [E, out, in / 32, 16], `<name>_scales` [E, out, in / 32]) by `quantize_mxfp4`."""
    if weight.dim() != 3:
        raise ValueError(f"an HF expert weight must be [E, in, out], got {tuple(weight.shape)}")
    blocks, scales = quantize_mxfp4(weight.transpose(1, 2))
    return blocks.contiguous(), scales.contiguous()


def packed_shapes(hf_shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Shapes of (blocks, scales) storing an HF expert weight [E, in, out], or None when `in` is not a
    multiple of 32 (the tensor cannot be MXFP4)."""
    experts, width, rows = hf_shape
    if width % BLOCK:
        return None
    return (experts, rows, width // BLOCK, BLOCK_BYTES), (experts, rows, width // BLOCK)
