"""Streams between our parameters and HF-named tensors, built on the one name table (`names`)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from megatron_gptoss.config import ModelConfig
from megatron_gptoss.errors import CheckpointError
from megatron_gptoss.hf.names import Match, from_hf, hf_shapes, match_hf, match_ours, to_hf
from megatron_gptoss.model.lora import adapter_of, is_adapter_param, merged_weight
from megatron_gptoss.model.mxfp4_weight import MXFP4Weight, mxfp4_weights


def iter_hf_tensors(model: nn.Module, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(hf_name, tensor) for every parameter of a single-device model, one parameter at a time.
    Tensors share memory with the parameters where the layout allows it (detached). LoRA adapters are
    merged into their layer's weight (W + scale * B A, fresh memory): the HF model is the adapted one.
    MXFP4 expert weights (`model.expert_format: mxfp4`) come dequantized (exactly) in their dtype, after the
    parameters."""
    params = dict(model.named_parameters())
    weights: dict[str, torch.Tensor | MXFP4Weight] = {**params, **mxfp4_weights(model)}
    for name, param in weights.items():
        if is_adapter_param(name):
            continue
        tensor = param.dequantize() if isinstance(param, MXFP4Weight) else param.detach()
        prefix = adapter_of(name)
        if prefix is not None and f"{prefix}.a" in params:
            a, b = params[f"{prefix}.a"].detach(), params[f"{prefix}.b"].detach()
            tensor = merged_weight(tensor, a, b, config.lora.scale)
        yield from to_hf(match_ours(name), tensor, config)


class HFAssembler:
    """Collects HF tensors (in any order) and emits (our_name, tensor) as soon as every HF part of a
    rule has arrived (q, k and v for the fused QKV). Shapes are checked against the config."""

    def __init__(self, config: ModelConfig):
        self.config = config
        self._pending: dict[str, dict[str, torch.Tensor]] = {}

    def add(self, hf_name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        match = match_hf(hf_name)
        if match is None:
            raise CheckpointError(f"unexpected tensor {hf_name!r}: not a GPT-OSS parameter")
        if match.layer is not None and match.layer >= self.config.num_layers:
            raise CheckpointError(
                f"unexpected tensor {hf_name!r}: layer {match.layer} "
                f"but the model has {self.config.num_layers} layers"
            )
        expected = dict(zip(match.hf, hf_shapes(match, self.config)))[hf_name]
        if tuple(tensor.shape) != tuple(expected):
            raise CheckpointError(
                f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(expected)}"
            )
        parts = self._pending.setdefault(match.ours, {})
        if hf_name in parts:
            raise CheckpointError(f"tensor {hf_name!r} given twice")
        parts[hf_name] = tensor
        if len(parts) < len(match.hf):
            return None
        del self._pending[match.ours]
        return match.ours, from_hf(match, [parts[n] for n in match.hf], self.config)

    def missing(self) -> list[str]:
        """HF names of rules started but not completed."""
        out: list[str] = []
        for ours, parts in self._pending.items():
            out.extend(n for n in match_ours(ours).hf if n not in parts)
        return sorted(out)


def load_hf_tensors(
    model: nn.Module, config: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]], strict: bool = True
) -> set[str]:
    """Copy HF-named tensors into `model`'s parameters in place (dtype converted). Returns the names of
    our parameters written. With `strict`, every parameter must be written exactly once."""
    params = dict(model.named_parameters())
    assembler = HFAssembler(config)
    written: set[str] = set()
    with torch.no_grad():
        for hf_name, tensor in tensors:
            done = assembler.add(hf_name, tensor)
            if done is None:
                continue
            name, value = done
            if name not in params:
                raise CheckpointError(f"tensor {hf_name!r} maps to {name!r}, which the model does not have")
            params[name].copy_(value)
            written.add(name)
    if assembler.missing():
        raise CheckpointError(f"missing tensors {assembler.missing()}")
    if strict:
        absent = sorted(set(params) - written)
        if absent:
            hf = [n for a in absent for n in match_ours(a).hf]
            raise CheckpointError(f"missing tensors {hf}")
    return written


def match_of(name: str) -> Match:
    return match_ours(name)
