"""The paged decode kernel: keys and values read through a block table give, for the last position of every
row, the training forward's output and LSE bit for bit (CPU under the Triton interpreter; bf16 at GPT-OSS
head shapes on a GPU). Pool blocks that belong to no row's view hold NaN, so a key read from the wrong block
shows; a sliding window's table starts at the row's first unreleased block; a padding row sees no key."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_gptoss.errors import AttentionInputError


def paged_case(lengths, hq, hkv, d, page, window, dtype, device, seed=0):
    """Inputs of `triton_paged_decode` for rows of `lengths` tokens (the last one is the query), one padding
    row appended; and the training forward's (out, lse) rows at each real row's last position."""
    from megatron_gptoss.ops.triton_sink_attention import triton_sink_attention

    g = torch.Generator().manual_seed(seed)
    longest = max(lengths)
    q, k, v = (torch.randn(len(lengths), longest, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv))
    sinks = torch.randn(hq, generator=g)
    q, k, v, sinks = (t.to(device) for t in (q, k, v, sinks))
    out, lse = triton_sink_attention(q, k, v, sinks, window=window, return_lse=True)
    pages = [(n + page - 1) // page for n in lengths]
    blocks = 1 + sum(pages) + 3  # block 0 and a few spare blocks stay NaN
    order = (torch.randperm(blocks - 1, generator=g) + 1).tolist()
    k_pool = torch.full((blocks, page, hkv, d), float("nan"), dtype=dtype, device=device)
    v_pool = k_pool.clone()
    tables, q_view = [], []
    for b, n in enumerate(lengths):
        first = 0 if window is None else max(0, n - window) // page  # first block with a visible key
        row = [order.pop() for _ in range(pages[b])]
        for i, block in enumerate(row[first:], start=first):
            span = slice(i * page, min((i + 1) * page, n))
            count = span.stop - span.start
            k_pool[block, :count], v_pool[block, :count] = k[b, span], v[b, span]
        tables.append(row[first:])
        q_view.append(n - 1 - first * page)
    width = max(len(t) for t in tables) + 2  # wider than any row (a bucketed view): the extra entries read 0
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables] + [[0] * width], device=device)
    positions = torch.tensor([n - 1 for n in lengths] + [0], device=device)
    q_view_t = torch.tensor(q_view + [-1], device=device)
    q_new = torch.cat([torch.stack([q[b, n - 1] for b, n in enumerate(lengths)]), q[:1, 0]])
    ref_out = torch.stack([out[b, n - 1] for b, n in enumerate(lengths)])
    ref_lse = torch.stack([lse[b, :, n - 1] for b, n in enumerate(lengths)])
    return (q_new, k_pool, v_pool, sinks, table, positions, q_view_t), (ref_out, ref_lse)


def check_rows(lengths, hq, hkv, d, page, window, dtype, device):
    from megatron_gptoss.ops.triton_paged_decode import triton_paged_decode

    args, (ref_out, ref_lse) = paged_case(lengths, hq, hkv, d, page, window, dtype, device)
    out, lse = triton_paged_decode(*args, window=window, return_lse=True)
    real = len(lengths)
    assert torch.equal(out[:real], ref_out)
    assert torch.equal(lse[:real], ref_lse)
    # the padding row: no key visible, O = 0 and LSE = the sink
    assert torch.equal(out[real], torch.zeros_like(out[real]))
    torch.testing.assert_close(lse[real], args[3].float(), rtol=1e-6, atol=0)  # base-2 round trip


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU Triton tests need TRITON_INTERPRET=1"
)
@pytest.mark.parametrize("window", [None, 6])
def test_paged_decode_rows_equal_training_rows_cpu(window):
    check_rows([37, 20, 5, 1, 16], 4, 2, 16, 4, window, torch.float32, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("window", [None, 128])
def test_paged_decode_rows_bitwise_equal_training_rows_gpu(window):
    check_rows([1000, 642, 129, 1, 64], 64, 8, 64, 16, window, torch.bfloat16, "cuda")


def test_paged_decode_rejects_bad_inputs():
    from megatron_gptoss.ops.triton_paged_decode import triton_paged_decode

    q = torch.zeros(2, 4, 16)
    pool = torch.zeros(3, 4, 2, 16)
    table, pos = torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, dtype=torch.long)
    sinks = torch.zeros(4)
    with pytest.raises(AttentionInputError, match="positions"):
        triton_paged_decode(q, pool, pool, sinks, table, pos.float(), pos)
    with pytest.raises(AttentionInputError, match="block_table"):
        triton_paged_decode(q, pool, pool, sinks, table[0], pos, pos)
    with pytest.raises(AttentionInputError, match="GQA"):
        triton_paged_decode(q[..., :8], pool, pool, sinks, table, pos, pos)
    with pytest.raises(AttentionInputError, match="sinks"):
        triton_paged_decode(q, pool, pool, sinks[:3], table, pos, pos)


def test_decode_tile_is_one_warp_of_the_training_tile():
    """A training tile with 16 rows a warp (the full-attention 128 x 8 warps, the window's 64 x 4) decodes on
    16 rows over one warp, its BLOCK_N and stages kept, for groups of up to 16 heads; other tiles (fp32 on a
    GPU, the interpreter's) and larger groups keep the training tile."""
    from megatron_gptoss.ops.triton_paged_decode import decode_config
    from megatron_gptoss.ops.triton_sink_attention import default_config

    gpu = torch.device("cuda")
    for windowed in (False, True):
        trained = default_config(64, torch.bfloat16, windowed, gpu)
        tile = decode_config(trained, group=8)
        assert trained.block_m == 16 * trained.fwd_warps >= 64
        assert (tile.block_m, tile.fwd_warps) == (16, 1)
        assert (tile.block_n, tile.fwd_stages) == (trained.block_n, trained.fwd_stages)
        assert decode_config(trained, group=32) == trained
    for dtype, device in ((torch.float32, gpu), (torch.float32, torch.device("cpu"))):
        kept = default_config(64, dtype, False, device)
        assert decode_config(kept) == kept


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU Triton tests need TRITON_INTERPRET=1"
)
def test_paged_decode_runs_a_given_tile_as_given(monkeypatch):
    """`tile` is launched as given, never mapped by `decode_config` as a training `config` is (a benchmark
    times a 64-row tile over 4 warps, which `decode_config` would turn into 16 rows): the decode tile given
    so equals the default launch bit for bit, and a tile narrower than the group is refused with its own
    row count."""
    import dataclasses

    from megatron_gptoss.ops import triton_paged_decode as module
    from megatron_gptoss.ops.triton_sink_attention import default_config

    args, _ = paged_case([37, 20, 5, 1, 16], 4, 2, 16, 4, None, torch.float32, "cpu")
    trained = default_config(16, torch.float32, False, torch.device("cpu"))
    tile = module.decode_config(trained, 2)
    default = module.triton_paged_decode(*args)

    def mapped(*_):
        raise AssertionError("decode_config applied to a given tile")

    monkeypatch.setattr(module, "decode_config", mapped)
    assert torch.equal(module.triton_paged_decode(*args, tile=tile), default)
    wide = dataclasses.replace(trained, block_m=64, fwd_warps=4)
    torch.testing.assert_close(module.triton_paged_decode(*args, tile=wide), default, rtol=1e-5, atol=1e-6)
    with pytest.raises(AttentionInputError, match="exceed the tile's 1 rows"):
        module.triton_paged_decode(*args, tile=dataclasses.replace(trained, block_m=1))
    with pytest.raises(AssertionError, match="decode_config applied"):
        module.triton_paged_decode(*args, config=trained)
