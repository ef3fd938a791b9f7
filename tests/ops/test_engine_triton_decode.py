"""The embedded engine on the Triton backend: its prefill chunks run `sink_decode`, its decode rows
`sink_paged_decode` (keys read through the block table), and its log-probs equal the learner's (Triton
training forward) for the same tokens."""

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

    calls: dict[str, int] = {}

    def counted(name, real):
        def run(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return real(*args, **kwargs)

        return run

    for name in ("sink_decode", "sink_paged_decode"):
        monkeypatch.setattr(attention, name, counted(name, getattr(attention, name)))
    outs = engine.generate([[1, 2, 3], [4, 5, 6, 7, 8]], SamplingParams(max_new_tokens=6, seed=3))
    # prefill chunks went through the dense decode kernel, decode rows through the paged one
    assert calls.get("sink_decode", 0) > 0 and calls.get("sink_paged_decode", 0) > 0
    with torch.no_grad():
        for out in outs:
            ids = torch.tensor(out.prompt_ids + out.token_ids, device=device)[None]
            hidden = learner.hidden_states(ids[:, :-1])
            ref = token_logprobs(hidden, learner.output_weight(), ids[:, 1:])[0][len(out.prompt_ids) - 1 :]
            assert (torch.tensor(out.logprobs) - ref.cpu()).abs().max() <= 1e-6
