"""MXFP4 byte formats: the released blocks' 16 bytes (32 FP4 codes, two a byte, low nibble first) re-encoded
for the kernels' decoding (`ops.mxfp4_kernels`, byte formats) and back. Every function takes and returns
uint8 [..., 16] (one block in the last dimension, blocks in K's order) and makes a copy.

    checkpoint   byte j: codes 2 j (low nibble), 2 j + 1 (high)
    shuffled     `shuffle_bytes`: each block as the transpose of its [4, 4] view (its own inverse)
    pairs        `pair_words` / `unpair_words`: four 32-bit words a block, word a the 8 codes lane a of a
                 quad of the matrix unit's operand takes, placed so that a shift and a mask give bf16 pairs

A held format names the byte format and the order of an expert's blocks (HELD_FORMATS): "checkpoint" and
"pairs" row-major ([E, out, in / 32] blocks, each row's in K's order); "tiled_pairs" the pairs' bytes stored
tile by tile (`tile_experts` / `untile_experts`: the same shapes and bytes, permuted within each expert) so
that the [TILE_ROWS, TILE_K / 2] bytes and [TILE_ROWS, TILE_K / 32] scales the forward kernel reads at one K
step of one column block are each one contiguous run, not TILE_ROWS runs a row apart.
"""

from __future__ import annotations

import torch
from torch import Tensor

BLOCK = 32  # values per MXFP4 block
BLOCK_BYTES = BLOCK // 2
HELD_FORMATS = ("checkpoint", "pairs", "tiled_pairs")  # the formats a model's MXFP4 weights may be held in
PAIRS_SCALES = (2, 128)  # the scale bytes "pairs" decodes exactly (weights up to 12 in magnitude)
TILE_ROWS = 64  # "tiled_pairs": output rows of a tile (the kernels' block_n)
TILE_K = 64  # "tiled_pairs": input columns of a tile (the kernels' block_k; two blocks of 32)


def check_held_format(byte_format: str) -> None:
    """Refuses a byte format a model's MXFP4 weights cannot be held in (HELD_FORMATS)."""
    if byte_format not in HELD_FORMATS:
        raise ValueError(f"MXFP4 weights are held in one of {HELD_FORMATS}, got {byte_format!r}")


def byte_format_of(held: str) -> str:
    """The byte format of a held format's blocks ("tiled_pairs": "pairs")."""
    check_held_format(held)
    return "pairs" if held == "tiled_pairs" else held


def is_tiled(held: str) -> bool:
    """Whether a held format stores each expert's blocks tile by tile (`tile_experts`)."""
    return held == "tiled_pairs"


def check_tileable(out_features: int, in_features: int, what: str = "this weight") -> None:
    """Refuses a weight [out, in] whose rows or columns do not fill whole tiles (TILE_ROWS x TILE_K), naming
    the width that does not."""
    for name, width, tile in (("out", out_features, TILE_ROWS), ("in", in_features, TILE_K)):
        if width % tile:
            raise ValueError(f"held format 'tiled_pairs' stores {TILE_ROWS} x {TILE_K} tiles; {what} has "
                             f"{name}_features={width}, not a multiple of {tile}")  # fmt: skip


def _tile_dims(t: Tensor) -> tuple[int, int, int, int]:
    """(E, row blocks, K steps, blocks a tile row) of blocks [E, R, G, 16] or scales [E, R, G] in
    TILE_ROWS x TILE_K tiles; refuses widths that do not fill whole tiles."""
    e, r, g = t.shape[:3]
    check_tileable(r, g * BLOCK, f"a weight of {tuple(t.shape)} bytes")
    per_tile = TILE_K // BLOCK
    return e, r // TILE_ROWS, g // per_tile, per_tile


def tile_experts(t: Tensor) -> Tensor:
    """Row-major blocks [E, R, G, 16] (or scales [E, R, G]) -> the same shape stored tile by tile: expert e's
    tile (row block b, K step s) is one contiguous run at offset (b G / per_tile + s) x tile size, its rows
    TILE_ROWS x (per_tile blocks) in order (per_tile = TILE_K / 32). R and 32 G must be multiples of
    TILE_ROWS and TILE_K. A copy."""
    e, blocks, steps, per_tile = _tile_dims(t)
    v = t.reshape(e, blocks, TILE_ROWS, steps, per_tile, *t.shape[3:])
    return v.transpose(2, 3).contiguous().reshape(t.shape)


def untile_experts(t: Tensor) -> Tensor:
    """`tile_experts`' inverse: blocks or scales stored tile by tile -> row-major (a copy)."""
    e, blocks, steps, per_tile = _tile_dims(t)
    v = t.reshape(e, blocks, steps, TILE_ROWS, per_tile, *t.shape[3:])
    return v.transpose(2, 3).contiguous().reshape(t.shape)


def check_pairs_scales(scales: Tensor, what: str = "these scales", remedy: str = "") -> None:
    """Refuses scale bytes outside PAIRS_SCALES, naming the range found (`what`: whose scales; `remedy`:
    appended to the message)."""
    if not scales.numel():
        return
    low, high = PAIRS_SCALES
    found = (int(scales.min()), int(scales.max()))
    if found[0] < low or found[1] > high:
        raise ValueError(f"byte format 'pairs' decodes scale bytes {low}..{high} exactly; {what} span "
                         f"{found[0]}..{found[1]}{remedy}")  # fmt: skip


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


def held_blocks(blocks: Tensor, held: str) -> Tensor:
    """The released blocks [E, out, in / 32, 16] as a model holds them in `held` (HELD_FORMATS): re-encoded
    into its byte format, stored tile by tile where it is tiled (the checkpoint's: as they are)."""
    blocks = pair_words(blocks) if byte_format_of(held) == "pairs" else blocks
    return tile_experts(blocks) if is_tiled(held) else blocks


def held_scales(scales: Tensor, held: str) -> Tensor:
    """The released scales [E, out, in / 32] as a model holds them in `held`: tile by tile where it is
    tiled, else as they are."""
    check_held_format(held)
    return tile_experts(scales) if is_tiled(held) else scales
