"""The value model of PPO's critic: the GPT-OSS body with a scalar head in place of the unembedding.

    input_ids [B, T] -> embedding -> N x (attention + MoE) -> final norm -> value_head -> values [B, T] fp32

`values[b, t]` estimates the return from the state that produces token t + 1 (the position whose
log-prob scores `targets[b, t]`). The head `value_head.weight` [1, H] is computed in fp32. A pipeline stage
of the value model is built like the policy's (`layers`, `pre_process`, `post_process`); the last stage
holds the head. `token_logprobs` answers with (values, zeros), so every pass that runs the policy's stages
and reads their per-token outputs (the pipeline schedules, packing) runs the critic unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from megatron_gptoss.config import ModelConfig
from megatron_gptoss.model.gpt_oss import GPTOSSModel

# parameter names only the value model has (the policy's HF name table does not know them)
VALUE_HEAD = "value_head.weight"


class ValueHead(nn.Module):
    """`weight` [1, H]: hidden [..., H] -> values [...] fp32."""

    def __init__(self, hidden: int, dtype=None, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, hidden, dtype=dtype, device=device))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(hidden.float(), self.weight.float()).squeeze(-1)


class ValueModel(GPTOSSModel):
    """GPTOSSModel without the output layer, with a `value_head` on the stage that post-processes."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device=None,
        layers: Sequence[int] | None = None,
        pre_process: bool = True,
        post_process: bool = True,
    ):
        super().__init__(config, dtype, device, layers, pre_process, post_process)
        self.output_layer = None
        self.value_head = ValueHead(config.hidden_size, dtype, device) if post_process else None

    def values(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states [..., H] -> values [...] fp32."""
        if self.value_head is None:
            raise RuntimeError("this pipeline stage has no value head (post_process=False)")
        return self.value_head(hidden)

    def token_logprobs(self, hidden, targets, temperature: float = 1.0, chunk_size: int = 1024):
        """(values, zeros) [...] fp32: the value model's answer to the policy's per-token pass (the targets,
        temperature and chunk size do not matter)."""
        values = self.values(hidden)
        return values, torch.zeros_like(values)

    def forward(self, input_ids, position_ids=None, cu_seqlens=None, max_seqlen=None, cache=None):
        """input_ids [B, T] -> values [B, T] fp32 (a stage without the head returns its hidden states)."""
        hidden = self.hidden_states(input_ids, position_ids, cu_seqlens, max_seqlen, cache)
        return self.values(hidden) if self.value_head is not None else hidden
