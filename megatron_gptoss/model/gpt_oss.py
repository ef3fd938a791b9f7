"""Single-device GPT-OSS in plain PyTorch with Megatron parameter names and fused layouts.

    input_ids [B, T] -> embedding -> N x (attention + MoE, pre-norm residual) -> final norm -> output_layer
    -> logits [B, T, vocab_size] (the padded vocabulary rows are dropped)

No collectives live here: tensor, expert, pipeline and data parallelism are applied from
`megatron_gptoss.parallel`. A pipeline stage is a GPTOSSModel holding a subset of the layers (keyed by
their global index), with the embedding only when `pre_process` and the final norm and output layer
only when `post_process` (Megatron's names).

Packed input: several documents per row, `position_ids` restart at each document and `cu_seqlens`
(int32 over the flattened B x T tokens) keeps attention inside documents.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatron_gptoss.config import ModelConfig
from megatron_gptoss.model.attention import SelfAttention
from megatron_gptoss.model.logprobs import token_logprobs
from megatron_gptoss.model.lora import adapters, freeze_base, is_adapter_param
from megatron_gptoss.model.moe import MoE
from megatron_gptoss.model.mxfp4_weight import mxfp4_weights
from megatron_gptoss.model.norm import RMSNorm
from megatron_gptoss.model.rope import RotaryEmbedding
from megatron_gptoss.ops import batch_invariant


class TransformerLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, dtype=None, device=None):
        super().__init__()
        self.self_attention = SelfAttention(config, layer, dtype, device)
        self.pre_mlp_layernorm = RMSNorm(config.hidden_size, config.norm_epsilon, dtype, device)
        self.mlp = MoE(config, dtype, device)

    def forward(self, x, cos, sin, cu_seqlens=None, max_seqlen=None, cache=None, positions=None, replay=None):
        x = x + self.self_attention(x, cos, sin, cu_seqlens, max_seqlen, cache, positions)
        mlp_in = self.pre_mlp_layernorm(x)
        return x + (self.mlp(mlp_in) if replay is None else self.mlp(mlp_in, replay))


class Decoder(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        dtype=None,
        device=None,
        layers: Sequence[int] | None = None,
        final_norm=True,
    ):
        super().__init__()
        indices = range(config.num_layers) if layers is None else layers
        # Keyed by the global layer index, so a pipeline stage that keeps a subset keeps the names.
        self.layers = nn.ModuleDict({str(i): TransformerLayer(config, i, dtype, device) for i in indices})
        self.final_layernorm: nn.Module | None = (
            RMSNorm(config.hidden_size, config.norm_epsilon, dtype, device) if final_norm else None
        )


class Embedding(nn.Module):
    def __init__(self, vocab_rows: int, hidden: int, dtype=None, device=None):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_rows, hidden, dtype=dtype, device=device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.word_embeddings(input_ids)


class OutputLayer(nn.Module):
    """The unembedding `weight` [padded_vocab, H]; rows past `vocab_size` are padding and never score.
    Tensor parallelism swaps in a vocab-parallel module with the same interface."""

    def __init__(self, hidden: int, rows: int, vocab_size: int, dtype=None, device=None):
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(rows, hidden, dtype=dtype, device=device))

    def real_weight(self) -> torch.Tensor:
        return self.weight[: self.vocab_size]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> logits [..., vocab_size]."""
        return batch_invariant.linear(hidden, self.real_weight())

    def logprobs(self, hidden, targets, temperature: float = 1.0, chunk_size: int = 1024):
        """(log-prob [...], entropy [...]) fp32 of `targets` under softmax(logits / temperature), chunked."""
        return token_logprobs(
            hidden,
            self.real_weight(),
            targets,
            temperature=temperature,
            chunk_size=chunk_size,
            with_entropy=True,
        )


class GPTOSSModel(nn.Module):
    """GPT-OSS causal LM. Parameters carry Megatron names (docs/architecture.md, "Names"); the vocabulary
    is padded.

    `layers` (global indices, default all), `pre_process` (holds the embedding) and `post_process`
    (holds the final norm and the output layer) build one pipeline stage; the defaults build the model.
    """

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device=None,
        layers: Sequence[int] | None = None,
        pre_process: bool = True,
        post_process: bool = True,
    ):
        super().__init__()
        self.config = config
        self.vocab_size = config.vocab_size
        rows = config.padded_vocab_size()
        self.pre_process, self.post_process = pre_process, post_process
        self.embedding = Embedding(rows, config.hidden_size, dtype, device) if pre_process else None
        self.rotary = RotaryEmbedding(config, device)
        self.decoder = Decoder(config, dtype, device, layers, final_norm=post_process)
        self.output_layer = (
            OutputLayer(config.hidden_size, rows, config.vocab_size, dtype, device) if post_process else None
        )
        self.activation_checkpointing = config.activation_checkpointing
        if config.lora.enabled:
            freeze_base(self)

    # ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> GPTOSSModel:
        """Normal(0, std) matrices, sinks and embeddings (`config.init_std_of(name)`); zero biases; unit
        norms; zero padded rows; then the adapters (`LoRA.reset`), so the base weights do not depend on LoRA
        being on. Raises ValueError for MXFP4 experts (`parallel.loading.init_parallel` draws and quantizes
        them)."""
        if mxfp4_weights(self):
            raise ValueError(
                "init_weights draws float experts: a model with model.expert_format='mxfp4' gets its random "
                "experts from parallel.loading.init_parallel (drawn, then quantized) or a checkpoint"
            )
        for name, p in self.named_parameters():
            if is_adapter_param(name):
                continue
            if name.endswith("layer_norm_weight") or name.endswith("layernorm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                std = self.config.init_std_of(name)
                p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float32).mul_(std).to(p.dtype))
        if self.embedding is not None:
            self.embedding.word_embeddings.weight[self.vocab_size :].zero_()
        if self.output_layer is not None:
            self.output_layer.weight[self.vocab_size :].zero_()
        for adapter in adapters(self):
            adapter.reset(generator)
        return self

    # ----------------------------------------------------------------------------------------------
    def hidden_states(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        cache=None,
        routing: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final-norm hidden states [B, T, H]. With `cache`, `position_ids` give each token's slot.
        `routing` [B * T, num_layers, k] (router replay): the experts of every token at every layer of the
        model (a stage reads its own layers'), `moe.no_route` where a token routes as usual.

        A stage without the embedding takes the previous stage's hidden states [B, T, H] in place of
        `input_ids` (then `position_ids` are required); a stage without the final norm returns its last
        layer's output."""
        batch, tokens = input_ids.shape[:2]
        if position_ids is None:
            if cache is not None or cu_seqlens is not None or self.embedding is None:
                raise ValueError(
                    "position_ids are required with a KV cache, packed sequences (cu_seqlens) or "
                    "hidden-state input"
                )
            position_ids = torch.arange(tokens, device=input_ids.device).expand(batch, tokens)
        x = self.embedding(input_ids) if self.embedding is not None else input_ids
        cos, sin = self.rotary(position_ids, x.dtype)
        for index, layer in self.decoder.layers.items():
            replay = None if routing is None else routing[:, int(index)]
            if self.activation_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(
                    layer,
                    x,
                    cos,
                    sin,
                    cu_seqlens,
                    max_seqlen,
                    cache,
                    position_ids,
                    replay,
                    use_reentrant=False,
                )
            else:
                x = layer(x, cos, sin, cu_seqlens, max_seqlen, cache, position_ids, replay)
        norm = self.decoder.final_layernorm
        return norm(x) if norm is not None else x

    def _head(self) -> OutputLayer:
        if self.output_layer is None:
            raise RuntimeError("this pipeline stage has no output layer (post_process=False)")
        return self.output_layer

    def output_weight(self) -> torch.Tensor:
        """Unembedding rows of the real vocabulary [vocab_size, H] (a view: padded rows never score)."""
        return self._head().real_weight()

    def token_logprobs(self, hidden, targets, temperature: float = 1.0, chunk_size: int = 1024):
        """Per-token (log-prob, entropy) of `targets` from final hidden states (`OutputLayer.logprobs`).

        A negative target marks a position whose log-prob nobody reads (a prompt, tool or padding token):
        it reads 0 (log-prob and entropy). On the CPU such positions skip the output layer (their number
        is known without a device sync); on accelerators every position runs through it and is masked
        afterwards, so the step keeps no data-dependent host synchronisation."""
        head = self._head()
        skip = targets < 0
        if hidden.device.type != "cpu":
            lp, ent = head.logprobs(hidden, targets.clamp_min(0), temperature, chunk_size)
            return lp.masked_fill(skip, 0.0), ent.masked_fill(skip, 0.0)
        if not bool(skip.any()):
            return head.logprobs(hidden, targets, temperature, chunk_size)
        keep = ~skip
        lp, ent = head.logprobs(hidden[keep], targets[keep], temperature, chunk_size)
        zeros = torch.zeros(targets.shape, dtype=lp.dtype, device=lp.device)
        return zeros.masked_scatter(keep, lp), zeros.masked_scatter(keep, ent)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        cache=None,
    ) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, vocab_size] (a stage without the output layer returns its
        hidden states)."""
        hidden = self.hidden_states(input_ids, position_ids, cu_seqlens, max_seqlen, cache)
        return self.output_layer(hidden) if self.output_layer is not None else hidden


def build_model(config: ModelConfig, dtype=torch.float32, device=None, seed: int = 0) -> GPTOSSModel:
    """A randomly initialised model (deterministic in `seed`)."""
    generator = torch.Generator().manual_seed(seed)
    return GPTOSSModel(config, dtype=dtype, device=device).init_weights(generator)
