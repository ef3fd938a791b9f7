"""Single-device GPT-OSS (no collectives inside): model, KV cache and the chunked log-prob path."""

from megatron_gptoss.model.gpt_oss import GPTOSSModel, build_model
from megatron_gptoss.model.kv_cache import KVCache
from megatron_gptoss.model.logprobs import token_logprobs

__all__ = ["GPTOSSModel", "KVCache", "build_model", "token_logprobs"]
