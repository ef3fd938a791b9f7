"""Build transformers' GptOssForCausalLM with exactly our model's weights (the numerical reference)."""

from __future__ import annotations

import torch

from megatron_gptoss.hf.convert import iter_hf_tensors


def hf_twin(model, attn_implementation: str = "eager"):
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = model.config.to_hf_config()
    hf_cfg = GptOssConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    hf_cfg._attn_implementation = attn_implementation
    dtype = next(model.parameters()).dtype
    ref = GptOssForCausalLM(hf_cfg).to(dtype)
    state = dict(iter_hf_tensors(model, model.config))
    missing, unexpected = ref.load_state_dict({k: v.clone() for k, v in state.items()}, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return ref.eval()


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    ours, ref = ours.detach().double(), ref.detach().double()
    return float((ours - ref).norm() / ref.norm().clamp_min(1e-30))
