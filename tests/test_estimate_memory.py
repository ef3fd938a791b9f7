"""tools/estimate_memory.py under context parallelism: the bytes the K/V exchange adds (ring and all-gather)
and the activations of a cp2 and a cp4 layout, against the formulas of the tool's docstring written out
with gpt-oss-120b's numbers (64 query heads, 8 KV heads of 64, window 128, 36 layers alternating)."""

import sys
from pathlib import Path

import pytest
from helpers.triton_cpu import interpreted

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from estimate_memory import Layout, activation_bytes_per_token, context_parallel_bytes, estimate  # noqa: E402

from megatron_gptoss.config import MODEL_PRESETS  # noqa: E402

CONFIG = MODEL_PRESETS["gpt_oss_120b"]()
HQ, HKV, D, W = 64, 8, 64, 128


def test_the_model_is_the_one_the_formulas_assume():
    c = CONFIG
    assert (c.num_attention_heads, c.num_query_groups, c.head_dim, c.sliding_window) == (HQ, HKV, D, W)
    assert c.num_layers == 36 and sum(c.window_of(n) is None for n in range(36)) == 18


def test_cp2_ring_activations():
    tokens, cp = 65536, 2
    c = tokens // (2 * cp)  # 16384
    rows = 2 * c * 4 * (HQ * D + HQ)  # fp32 (O_r, LSE_r) of the 2c local rows
    blocks = 2 * (2 * c) * (2 * HKV * D) * 2  # two bf16 K/V blocks of 2c tokens
    accumulators = 2 * (2 * c) * (2 * HKV * D) * 4  # two fp32 dK/dV accumulators of a block
    tails = 2 * cp * (W - 1) * (2 * HKV * D) * 2  # every chunk's last W - 1 keys and values
    layout = Layout(gpus=2, ep=2, cp=cp)
    got = context_parallel_bytes(CONFIG, layout, tokens)
    assert got == {"full": rows, "window": rows + tails, "exchange": blocks + accumulators}
    assert got["exchange"] == 402_653_184  # 0.375 GiB: 12 bytes x 2c x 2 x 512 K/V elements
    local = activation_bytes_per_token(CONFIG) * tokens / cp
    expected = 36 * local + 18 * rows + 18 * (rows + tails) + blocks + accumulators
    assert estimate(CONFIG, layout, tokens)["activations"] == pytest.approx(expected, rel=1e-12)


def test_cp4_tp2_ring_with_recompute_and_the_all_gather():
    tokens, cp, tp = 131072, 4, 2
    c = tokens // (2 * cp)  # 16384
    kv = 2 * (HKV // tp) * D  # K and V elements of a token on a tp rank
    rows = 2 * c * 4 * (HQ // tp) * (D + 1)
    tails = 2 * cp * (W - 1) * kv * 2
    layout = Layout(gpus=8, tp=tp, ep=8, cp=cp, sequence_parallel=True)
    ring = context_parallel_bytes(CONFIG, layout, tokens)
    assert ring == {"full": rows, "window": rows + tails, "exchange": 2 * c * kv * 12}
    gathered = tokens * kv * 2  # the all-gather holds the whole micro-batch's keys and values
    assert context_parallel_bytes(CONFIG, layout, tokens, "all_gather") == {
        "full": rows + gathered,
        "window": rows + tails,
        "exchange": gathered,
    }
    # recompute: every layer's bf16 input (sequence parallel: 1/tp of the tokens), one layer's activations
    # but its first norm's input (that same kept input), and its exchange
    local = tokens // cp
    per_token = activation_bytes_per_token(CONFIG, tp, sequence_parallel=True)
    kept = 2 * CONFIG.hidden_size / tp
    expected = kept * local * 36 + (per_token - kept) * local + rows + 2 * c * kv * 12
    got = estimate(CONFIG, layout, tokens, activation_checkpointing=True)["activations"]
    assert got == pytest.approx(expected, rel=1e-12)


def test_windows_wider_than_a_chunk_go_around_the_ring_and_cp1_adds_nothing():
    layout = Layout(gpus=4, ep=4, cp=4)
    short = context_parallel_bytes(CONFIG, layout, 512)  # c = 64 < W - 1: window layers on the ring
    assert short["window"] == short["full"]
    assert context_parallel_bytes(CONFIG, Layout(gpus=1), 4096) == {"full": 0, "window": 0, "exchange": 0}
    plain = estimate(CONFIG, Layout(gpus=1), 4096)["activations"]
    assert plain == pytest.approx(activation_bytes_per_token(CONFIG) * 4096 * 36, rel=1e-12)
    with pytest.raises(ValueError, match="multiple of 2 x cp = 8"):
        context_parallel_bytes(CONFIG, layout, 4100)
    with pytest.raises(ValueError, match="kv_exchange"):
        context_parallel_bytes(CONFIG, layout, 4096, "gather")


def _saved_bytes(layer, config, tokens: int) -> int:
    """Bytes of the tensors one layer's forward saves for its backward on `tokens` packed tokens (storages
    counted once, parameters left out; the layer's input counts, as in a model where the previous layer's
    output is kept for this layer's backward only)."""
    import torch

    from megatron_gptoss.model.rope import RotaryEmbedding

    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    x = torch.randn(1, tokens, config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = RotaryEmbedding(config)(torch.arange(tokens)[None], torch.bfloat16)
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    cu_seqlens = torch.tensor([0, tokens], dtype=torch.int32)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, cos, sin, cu_seqlens=cu_seqlens, max_seqlen=tokens)
    return sum(saved.values())


# (hidden, intermediate, query heads, KV heads, head dim, experts, top-k): GQA and not, k 4 and 2
WIDTHS = [(64, 48, 8, 2, 16, 8, 4), (48, 80, 4, 4, 32, 4, 2)]
WIDTH_NAMES = ("hidden_size", "intermediate_size", "num_attention_heads", "num_query_groups", "head_dim",
               "num_experts", "moe_router_topk")  # fmt: skip


@interpreted
@pytest.mark.parametrize("widths", WIDTHS)
def test_activation_bytes_are_what_the_cuda_path_saves(monkeypatch, widths):
    """`activation_bytes_per_token` against the bytes one layer (bf16) saves per token, counted on the CUDA
    path's kernels (fused RMSNorm, rotary, sink attention, permute / SwiGLU / unpermute of the experts),
    forced on CPU tensors under the Triton interpreter: the slope between 64 and 128 tokens."""
    import dataclasses

    import torch

    from megatron_gptoss.model import attention, gpt_oss, norm
    from megatron_gptoss.ops.rms_norm import fused_rms_norm

    for module in (norm, attention):
        monkeypatch.setattr(module, "rms_norm", fused_rms_norm)
    monkeypatch.setattr(attention.SelfAttention, "_fused_rotary", staticmethod(lambda qkv, cos: True))
    backends = {"attention_backend": "triton", "expert_backend": "grouped_mm"}
    layers = {"num_layers": 2, "layer_types": ["sliding", "full"], "vocab_size": 128}
    config = dataclasses.replace(CONFIG, **layers, **backends, **dict(zip(WIDTH_NAMES, widths)))
    torch.manual_seed(0)
    layer = gpt_oss.TransformerLayer(config, 1, torch.bfloat16, "cpu")
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    per_token = (_saved_bytes(layer, config, 128) - _saved_bytes(layer, config, 64)) / 64
    assert per_token == activation_bytes_per_token(config)
