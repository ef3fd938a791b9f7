"""The embedded engine on the Triton backend: its cached decode runs `sink_decode`, and its log-probs
equal the learner's (Triton training forward) for the same tokens."""

import torch

from megatron_gptoss.config import gpt_oss_tiny
from megatron_gptoss.hf.convert import iter_hf_tensors
from megatron_gptoss.model import build_model, token_logprobs
from megatron_gptoss.ops import backend_available
from megatron_gptoss.rollout import EmbeddedEngine, SamplingParams


def test_engine_with_triton_decode_matches_learner(monkeypatch):
    if not backend_available("triton"):
        import pytest

        pytest.skip("triton not available")
    cfg = gpt_oss_tiny(attention_backend="triton", num_layers=2, sliding_window=4)
    learner = build_model(cfg, seed=0)
    with torch.no_grad():
        for p in learner.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs Triton under its interpreter
    learner.to(device)
    engine = EmbeddedEngine(cfg, device=device, seed=0)
    engine.update_weights(iter_hf_tensors(learner, cfg))

    import megatron_gptoss.model.attention as attention

    calls = []
    real = attention.sink_decode
    monkeypatch.setattr(attention, "sink_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    outs = engine.generate([[1, 2, 3], [4, 5, 6, 7, 8]], SamplingParams(max_new_tokens=6, seed=3))
    assert calls  # the cache path went through the Triton decode kernel
    with torch.no_grad():
        for out in outs:
            ids = torch.tensor(out.prompt_ids + out.token_ids, device=device)[None]
            hidden = learner.hidden_states(ids[:, :-1])
            ref = token_logprobs(hidden, learner.output_weight(), ids[:, 1:])[0][len(out.prompt_ids) - 1 :]
            assert (torch.tensor(out.logprobs) - ref.cpu()).abs().max() <= 1e-6
