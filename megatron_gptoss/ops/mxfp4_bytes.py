"""MXFP4 byte formats: the released blocks' 16 bytes (32 FP4 codes, two a byte, low nibble first) re-encoded
for the kernels' decoding (`ops.mxfp4_kernels`, byte formats) and back. Every function takes and returns
uint8 [..., 16] (one block in the last dimension, blocks in K's order) and makes a copy.

    checkpoint   byte j: codes 2 j (low nibble), 2 j + 1 (high)
    shuffled     `shuffle_bytes`: each block as the transpose of its [4, 4] view (its own inverse)
    pairs        `pair_words` / `unpair_words`: four 32-bit words a block, word a the 8 codes lane a of a
                 quad of the matrix unit's operand takes, placed so that a shift and a mask give bf16 pairs
"""

from __future__ import annotations

import torch
from torch import Tensor

BLOCK = 32  # values per MXFP4 block
BLOCK_BYTES = BLOCK // 2


def shuffle_bytes(blocks: Tensor) -> Tensor:
    """MXFP4 bytes [..., 16] (blocks in K's order) -> each block stored as the transpose of its [4, 4] view:
    byte 4 b + a at 4 a + b, so that the bytes one thread of the matrix unit's operand decodes (every fourth:
    the K pairs of bytes a, a + 4, a + 8, a + 12 at lane a of each quad) are side by side. Its own inverse.
    A copy."""
    if blocks.shape[-1] != BLOCK_BYTES:
        raise ValueError(f"blocks must end in {BLOCK_BYTES} bytes a block, got {tuple(blocks.shape)}")
    return blocks.reshape(*blocks.shape[:-1], 4, 4).transpose(-1, -2).reshape(blocks.shape).contiguous()


def pair_words(blocks: Tensor) -> Tensor:
    """MXFP4 bytes [..., 16] (blocks in K's order) -> byte format "pairs": each block as four little-endian
    32-bit words, word a holding the codes of bytes a, a + 4, a + 8, a + 12 (the K pairs 2 (a + 4 i), + 1)
    with pair i's two codes in slot i: slots 0..2 the sign at bits 15 - 3 i and 31 - 3 i, exponent and
    mantissa at 8 - 3 i .. 6 - 3 i and 24 - 3 i .. 22 - 3 i; slot 3 the sign at 14 / 30, the exponent at
    11, 10 / 27, 26, the mantissa at 13 / 29 (the kernels' `_PAIRS_BF16_PTX` reads them). A copy."""
    if blocks.shape[-1] != BLOCK_BYTES:
        raise ValueError(f"blocks must end in {BLOCK_BYTES} bytes a block, got {tuple(blocks.shape)}")
    b = (
        blocks.reshape(*blocks.shape[:-1], 4, 4).transpose(-1, -2).to(torch.int64)
    )  # [..., a, i]: byte 4 i + a
    word = torch.zeros(b.shape[:-1], dtype=torch.int64, device=blocks.device)
    for i in range(4):
        for half, code in ((0, b[..., i] & 15), (16, b[..., i] >> 4)):
            sign, e1, e0, m = (code >> 3) & 1, (code >> 2) & 1, (code >> 1) & 1, code & 1
            if i < 3:
                at = (15 - 3 * i, 8 - 3 * i, 7 - 3 * i, 6 - 3 * i)
            else:
                at = (14, 11, 10, 13)
            for bit, pos in zip((sign, e1, e0, m), at):
                word |= bit << (pos + half)
    out = torch.stack([(word >> (8 * j)) & 255 for j in range(4)], dim=-1)  # little-endian bytes of word a
    return out.to(torch.uint8).reshape(blocks.shape).contiguous()


def unpair_words(blocks: Tensor) -> Tensor:
    """`pair_words`' inverse: byte format "pairs" [..., 16] -> the checkpoint's bytes (a copy)."""
    if blocks.shape[-1] != BLOCK_BYTES:
        raise ValueError(f"blocks must end in {BLOCK_BYTES} bytes a block, got {tuple(blocks.shape)}")
    w = blocks.reshape(*blocks.shape[:-1], 4, 4).to(torch.int64)
    word = w[..., 0] | w[..., 1] << 8 | w[..., 2] << 16 | w[..., 3] << 24  # [..., a]
    natural = torch.zeros(*blocks.shape[:-1], 4, 4, dtype=torch.int64, device=blocks.device)  # [..., i, a]
    for i in range(4):
        at = (15 - 3 * i, 8 - 3 * i, 7 - 3 * i, 6 - 3 * i) if i < 3 else (14, 11, 10, 13)
        for half in (0, 16):
            code = sum(((word >> (pos + half)) & 1) << bit for bit, pos in zip((3, 2, 1, 0), at))
            natural[..., i, :] |= code << (4 if half else 0)
    return natural.reshape(blocks.shape).to(torch.uint8).contiguous()  # byte 4 i + a
