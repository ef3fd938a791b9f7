"""The one declarative table between our (Megatron) parameter names and HF GPT-OSS names.

Each rule names our tensor, the HF tensor(s) it is made of and the layout change between them.
Import reads rules left to right (`from_hf`), export right to left (`to_hf`); nothing else in the
project spells an HF name. `{L}` stands for the layer index.

Layout kinds:
    same       identical tensor
    vocab      rows [vocab_size, H] in HF, padded with zero rows to [padded_vocab, H] here
    qkv        HF q/k/v_proj (weight [Hq d, H] / bias) <-> one tensor grouped per KV head:
               [q heads of group g, k_g, v_g] x head_dim rows per group
    fc1        HF gate_up_proj [E, H, 2I] (gate, up interleaved on the last dim) <-> [E, 2I, H] as [gate; up]
    fc1_bias   HF gate_up_proj_bias [E, 2I] interleaved <-> [E, 2I] as [gate; up]
    fc2        HF down_proj [E, I, H] <-> [E, H, I]
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from megatron_gptoss.config import ModelConfig


@dataclass(frozen=True)
class Rule:
    ours: str
    hf: tuple[str, ...]
    kind: str = "same"


_ATTN = "model.layers.{L}.self_attn"
_MLP = "model.layers.{L}.mlp"
_OURS = "decoder.layers.{L}"

RULES: tuple[Rule, ...] = (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"),
    Rule(
        f"{_OURS}.self_attention.linear_qkv.layer_norm_weight", ("model.layers.{L}.input_layernorm.weight",)
    ),
    Rule(
        f"{_OURS}.self_attention.linear_qkv.weight",
        (f"{_ATTN}.q_proj.weight", f"{_ATTN}.k_proj.weight", f"{_ATTN}.v_proj.weight"),
        "qkv",
    ),
    Rule(
        f"{_OURS}.self_attention.linear_qkv.bias",
        (f"{_ATTN}.q_proj.bias", f"{_ATTN}.k_proj.bias", f"{_ATTN}.v_proj.bias"),
        "qkv",
    ),
    Rule(f"{_OURS}.self_attention.core_attention.softmax_offset", (f"{_ATTN}.sinks",)),
    Rule(f"{_OURS}.self_attention.linear_proj.weight", (f"{_ATTN}.o_proj.weight",)),
    Rule(f"{_OURS}.self_attention.linear_proj.bias", (f"{_ATTN}.o_proj.bias",)),
    Rule(f"{_OURS}.pre_mlp_layernorm.weight", ("model.layers.{L}.post_attention_layernorm.weight",)),
    Rule(f"{_OURS}.mlp.router.weight", (f"{_MLP}.router.weight",)),
    Rule(f"{_OURS}.mlp.router.bias", (f"{_MLP}.router.bias",)),
    Rule(f"{_OURS}.mlp.experts.linear_fc1.weight", (f"{_MLP}.experts.gate_up_proj",), "fc1"),
    Rule(f"{_OURS}.mlp.experts.linear_fc1.bias", (f"{_MLP}.experts.gate_up_proj_bias",), "fc1_bias"),
    Rule(f"{_OURS}.mlp.experts.linear_fc2.weight", (f"{_MLP}.experts.down_proj",), "fc2"),
    Rule(f"{_OURS}.mlp.experts.linear_fc2.bias", (f"{_MLP}.experts.down_proj_bias",)),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",)),
    Rule("output_layer.weight", ("lm_head.weight",), "vocab"),
)


def _pattern(template: str) -> re.Pattern:
    return re.compile("^" + re.escape(template).replace(re.escape("{L}"), r"(?P<L>\d+)") + "$")


_OURS_PATTERNS = [(_pattern(rule.ours), rule) for rule in RULES]
_HF_PATTERNS = [(_pattern(hf), rule, i) for rule in RULES for i, hf in enumerate(rule.hf)]


@dataclass(frozen=True)
class Match:
    rule: Rule
    layer: int | None

    @property
    def ours(self) -> str:
        return _fill(self.rule.ours, self.layer)

    @property
    def hf(self) -> tuple[str, ...]:
        return tuple(_fill(h, self.layer) for h in self.rule.hf)


def _fill(template: str, layer: int | None) -> str:
    return template if layer is None else template.replace("{L}", str(layer))


def match_ours(name: str) -> Match:
    for pattern, rule in _OURS_PATTERNS:
        m = pattern.match(name)
        if m:
            return Match(rule, int(m["L"]) if "L" in m.groupdict() else None)
    raise KeyError(f"no HF counterpart for parameter {name!r}")


def match_hf(name: str) -> Match | None:
    """The rule an HF tensor name belongs to, or None for a name outside the table."""
    for pattern, rule, _ in _HF_PATTERNS:
        m = pattern.match(name)
        if m:
            return Match(rule, int(m["L"]) if "L" in m.groupdict() else None)
    return None


def hf_names(config: ModelConfig) -> list[str]:
    """Every HF tensor name of a model with `config`, in table order, layers ascending."""
    names: list[str] = []
    for ours in our_names(config):
        names.extend(match_ours(ours).hf)
    return names


def our_names(config: ModelConfig) -> list[str]:
    """Every parameter name of our model with `config` (biases included when the config has them)."""
    names: list[str] = []
    for rule in RULES:
        if rule.ours.endswith(".bias") and not config.add_bias_linear:
            continue
        if "{L}" in rule.ours:
            names.extend(_fill(rule.ours, layer) for layer in range(config.num_layers))
        else:
            names.append(rule.ours)
    layered = [n for n in names if n.startswith("decoder.layers.")]
    layered.sort(key=lambda n: int(n.split(".")[2]))
    return [names[0], *layered, *[n for n in names[1:] if not n.startswith("decoder.layers.")]]


# ------------------------------------------------------------------------------------------------
# Layout changes
def _qkv_sizes(config: ModelConfig) -> tuple[int, int, int]:
    return config.num_query_groups, config.num_attention_heads // config.num_query_groups, config.head_dim


def hf_shapes(match: Match, config: ModelConfig) -> tuple[tuple[int, ...], ...]:
    """Expected HF shapes of the tensors behind `match` (unpadded vocabulary)."""
    h, i, e = config.hidden_size, config.intermediate_size, config.num_experts
    groups, per, d = _qkv_sizes(config)
    kind, name = match.rule.kind, match.rule.ours
    if kind == "vocab":
        return ((config.vocab_size, h),)
    if kind == "qkv":
        tail = (h,) if name.endswith("weight") else ()
        return ((groups * per * d, *tail), (groups * d, *tail), (groups * d, *tail))
    if kind == "fc1":
        return ((e, h, 2 * i),)
    if kind == "fc1_bias":
        return ((e, 2 * i),)
    if kind == "fc2":
        return ((e, i, h),)
    shapes = {
        "layer_norm_weight": (h,),
        "softmax_offset": (config.num_attention_heads,),
        "linear_proj.weight": (h, config.num_attention_heads * d),
        "linear_proj.bias": (h,),
        "pre_mlp_layernorm.weight": (h,),
        "router.weight": (e, h),
        "router.bias": (e,),
        "linear_fc2.bias": (e, h),
        "final_layernorm.weight": (h,),
    }
    for suffix, shape in shapes.items():
        if name.endswith(suffix):
            return (shape,)
    raise KeyError(f"no shape rule for {name}")


def from_hf(match: Match, tensors: list[torch.Tensor], config: ModelConfig) -> torch.Tensor:
    """HF tensor(s) of one rule -> our tensor (vocabulary padded with zero rows)."""
    kind = match.rule.kind
    if kind == "same":
        return tensors[0]
    if kind == "vocab":
        rows = config.padded_vocab_size()
        t = tensors[0]
        return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if rows > t.shape[0] else t
    if kind == "qkv":
        groups, per, d = _qkv_sizes(config)
        q, k, v = tensors
        tail = q.shape[1:]
        q = q.reshape(groups, per * d, *tail)
        k = k.reshape(groups, d, *tail)
        v = v.reshape(groups, d, *tail)
        return torch.cat([q, k, v], dim=1).reshape(groups * (per + 2) * d, *tail)
    if kind == "fc1":
        t = tensors[0]
        return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1).transpose(1, 2).contiguous()
    if kind == "fc1_bias":
        t = tensors[0]
        return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)
    if kind == "fc2":
        return tensors[0].transpose(1, 2).contiguous()
    raise KeyError(kind)


def fc1_rows_from_hf(t: torch.Tensor) -> torch.Tensor:
    """Rows (dim 1) of an fc1 expert tensor [E, 2I, ...] in HF's interleaved gate/up order -> [gate; up]
    (the MXFP4 blocks and scales of `gate_up_proj`, whose rows are its output columns)."""
    return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1)


def fc1_rows_to_hf(t: torch.Tensor) -> torch.Tensor:
    """The inverse of `fc1_rows_from_hf`: [gate; up] rows -> interleaved."""
    gate, up = t.chunk(2, dim=1)
    return torch.stack([gate, up], dim=2).flatten(1, 2)


def to_hf(match: Match, tensor: torch.Tensor, config: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """Our tensor -> [(hf_name, tensor)], the exact inverse of `from_hf` (vocabulary padding dropped)."""
    kind, names = match.rule.kind, match.hf
    if kind == "same":
        out = [tensor]
    elif kind == "vocab":
        out = [tensor[: config.vocab_size]]
    elif kind == "qkv":
        groups, per, d = _qkv_sizes(config)
        tail = tensor.shape[1:]
        grouped = tensor.reshape(groups, (per + 2) * d, *tail)
        q = grouped[:, : per * d].reshape(groups * per * d, *tail)
        k = grouped[:, per * d : (per + 1) * d].reshape(groups * d, *tail)
        v = grouped[:, (per + 1) * d :].reshape(groups * d, *tail)
        out = [q, k, v]
    elif kind in ("fc1", "fc1_bias"):
        t = tensor.transpose(1, 2) if kind == "fc1" else tensor
        gate, up = t.chunk(2, dim=-1)
        out = [torch.stack([gate, up], dim=-1).flatten(-2)]
    elif kind == "fc2":
        out = [tensor.transpose(1, 2)]
    else:
        raise KeyError(kind)
    return [(n, t.contiguous()) for n, t in zip(names, out)]
