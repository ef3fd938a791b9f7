"""A GPT-OSS checkpoint whose policy is a known bigram model, so a run with random-free structure calls
tools: every layer's output projections are zero (each layer adds nothing to the residual stream), so the
next-token distribution depends only on the current token, through the embedding and the output layer.

After `<|start|>assistant` it samples, with equal odds at each branch, from the continuations of

    <|channel|>commentary to=functions.calculator <|constrain|>json<|message|>{"expression": "2+3"}<|call|>
    <|channel|>final<|message|>5<|return|>

so its trajectories mix well-formed calculator calls, final answers, and malformed turns (a call on the
final channel, a final answer on the commentary channel), all in the real o200k_harmony tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_gptoss.config.model import gpt_oss_tiny
from megatron_gptoss.harmony import CALL, CHANNEL, CONSTRAIN, MESSAGE, RETURN, get_tokenizer
from megatron_gptoss.hf.io import save_hf
from megatron_gptoss.model.gpt_oss import build_model

ZEROED = ("linear_proj.weight", "linear_proj.bias", "linear_fc2.weight", "linear_fc2.bias")
LOGIT = 24.0  # a successor's logit; every other token's is 0 (about 201,088 x e^-24 = 8e-6 of the mass)


def continuations() -> list[list[int]]:
    """The two scripted turns after `<|start|>`, `assistant` included."""
    tok = get_tokenizer()
    call = [
        *tok.encode("assistant"),
        CHANNEL,
        *tok.encode("commentary to=functions.calculator "),
        CONSTRAIN,
        *tok.encode("json"),
        MESSAGE,
        *tok.encode('{"expression": "2+3"}'),
        CALL,
    ]
    final = [*tok.encode("assistant"), CHANNEL, *tok.encode("final"), MESSAGE, *tok.encode("5"), RETURN]
    return [call, final]


def transitions() -> dict[int, set[int]]:
    """Each token of the scripted turns -> the tokens that may follow it."""
    out: dict[int, set[int]] = {}
    for ids in continuations():
        for a, b in zip(ids, ids[1:]):
            out.setdefault(a, set()).add(b)
    return out


def write_scripted_checkpoint(path: Path, **model_overrides) -> Path:
    """The bigram policy as an HF directory (float32) of `gpt_oss_tiny` with the full harmony vocabulary."""
    config = gpt_oss_tiny(vocab_size=201088, **model_overrides)
    model = build_model(config, torch.float32, seed=0)
    table = transitions()
    slots = {t: i for i, t in enumerate(sorted(set(table) | {b for bs in table.values() for b in bs}))}
    hidden = config.hidden_size
    if len(slots) > hidden:
        raise ValueError(f"{len(slots)} scripted tokens need hidden_size >= {len(slots)}")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(ZEROED):
                p.zero_()  # the layer adds nothing: the residual stream stays the token's embedding
        emb = model.embedding.word_embeddings.weight
        head = model.output_layer.weight
        emb.zero_()
        head.zero_()
        for token, slot in slots.items():
            emb[token, slot] = 1.0  # after the final norm: sqrt(hidden) on this slot
        for token, nexts in table.items():
            for nxt in nexts:
                head[nxt, slots[token]] = LOGIT / hidden**0.5
    return save_hf(model, path, dtype=torch.float32)
