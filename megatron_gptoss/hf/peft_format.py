"""LoRA adapters in PEFT's format (`adapter_config.json` + `adapter_model.safetensors`), loadable with
`peft.PeftModel.from_pretrained` onto transformers' GptOssForCausalLM holding the base weights.

How our adapters map (E experts, r the rank; PEFT keys start `base_model.model.model.layers.{L}.`):

- `linear_qkv.lora` (a [r, H], b [(q + 2kv) d, r]) -> modules `self_attn.{q,k,v}_proj`: each gets
  lora_A = a (the shared A, copied) and lora_B = the rows of b for that projection (the per-KV-group
  grouping of the fused QKV undone, as for the weight).
- `linear_proj.lora` -> module `self_attn.o_proj`: lora_A = a, lora_B = b.
- `router.lora` -> parameter `mlp.router.weight`: lora_A = a [r, H], lora_B = b [E, r].
- `linear_fc1.lora` (a [E, r, H], b [E, 2I, r]) -> parameter `mlp.experts.gate_up_proj`: lora_A [E r, H]
  with row e r + j = a[e, j]; lora_B [2I, r E] with column j E + e = b[e, :, j], its rows interleaved
  (gate, up) like `gate_up_proj`'s columns.
- `linear_fc2.lora` (a [E, r, I], b [E, H, r]) -> parameter `mlp.experts.down_proj`: lora_A [E r, I],
  lora_B [H, r E], the same per-expert packing.

Expert adapters use PEFT's `target_parameters` (a LoRA per expert on the 3-d parameters, PEFT >= 0.17;
transformers marks GptOssExperts' parameters as [E, in, out], so PEFT's A maps `in` and B `out` as ours).
With both expert targets PEFT nests its wrappers: `gate_up_proj`'s tensors sit under
`mlp.experts.base_layer.`, `down_proj`'s under `mlp.experts.`. PEFT's parameter wrappers take no dropout:
the config is written with `lora_dropout` 0 when the router or the experts are targeted (dropout acts in
training only; the adapter's function is the same). Everything `model.lora` can target is expressible.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from megatron_gptoss.config import ModelConfig
from megatron_gptoss.errors import CheckpointError
from megatron_gptoss.hf.names import match_ours, to_hf

PEFT_VERSION = "0.21.2"  # the version the format is tested against (the dev extra's pin)
PREFIX = "base_model.model."
_ATTN = "model.layers.{L}.self_attn"
_MLP = "model.layers.{L}.mlp"


def _experts(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a [E, r, in], b [E, out, r] -> PEFT's (lora_A [E r, in], lora_B [out, r E])."""
    experts, rank, width = a.shape
    return a.reshape(experts * rank, width), b.permute(1, 2, 0).reshape(b.shape[1], rank * experts)


def peft_tensors(adapters: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Our full adapter tensors (`decoder.layers.{L}.<layer>.lora.a` / `.b`, every layer of every target)
    -> PEFT's state dict (module docstring)."""
    targets = config.lora.targets
    both_experts = "linear_fc1" in targets and "linear_fc2" in targets
    out: dict[str, torch.Tensor] = {}

    def put(module: str, a: torch.Tensor, b: torch.Tensor) -> None:
        out[f"{PREFIX}{module}.lora_A.weight"] = a.contiguous()
        out[f"{PREFIX}{module}.lora_B.weight"] = b.contiguous()

    for layer in range(config.num_layers):
        ours = f"decoder.layers.{layer}"
        attn, mlp = _ATTN.format(L=layer), _MLP.format(L=layer)

        def pair(path: str, ours=ours) -> tuple[torch.Tensor, torch.Tensor]:
            key = f"{ours}.{path}.lora"
            if f"{key}.a" not in adapters or f"{key}.b" not in adapters:
                raise CheckpointError(f"the adapters lack {key}.a / {key}.b")
            return adapters[f"{key}.a"], adapters[f"{key}.b"]

        if "linear_qkv" in targets:
            a, b = pair("self_attention.linear_qkv")
            rule = match_ours(f"{ours}.self_attention.linear_qkv.weight")
            for name, rows in to_hf(rule, b, config):  # q, k and v rows, each with the shared A
                put(name.removesuffix(".weight"), a, rows)
        if "linear_proj" in targets:
            put(f"{attn}.o_proj", *pair("self_attention.linear_proj"))
        if "router" in targets:
            put(f"{mlp}.router", *pair("mlp.router"))
        if "linear_fc1" in targets:
            a, b = pair("mlp.experts.linear_fc1")
            (_, hf_b), *_ = to_hf(match_ours(f"{ours}.mlp.experts.linear_fc1.weight"), b, config)
            lora_a, _ = _experts(a, b)  # hf_b [E, r, 2I] interleaved: lora_B column j E + e = hf_b[e, j]
            lora_b = hf_b.permute(2, 1, 0).reshape(hf_b.shape[2], -1)
            put(f"{mlp}.experts.base_layer" if both_experts else f"{mlp}.experts", lora_a, lora_b)
        if "linear_fc2" in targets:
            put(f"{mlp}.experts", *_experts(*pair("mlp.experts.linear_fc2")))
    return out


def peft_config(config: ModelConfig, base_model: str | None = None) -> dict:
    """adapter_config.json of `config.lora` (built with PEFT's LoraConfig, so its defaults are PEFT's)."""
    try:
        from peft import LoraConfig
    except ImportError as err:
        raise CheckpointError(f"the PEFT export needs peft (pip install peft=={PEFT_VERSION})") from err
    targets = config.lora.targets
    modules = [m for t, ms in _MODULES.items() if t in targets for m in ms]
    parameters = [p for t, p in _PARAMETERS.items() if t in targets]
    lora = LoraConfig(
        r=config.lora.rank,
        lora_alpha=config.lora.alpha,  # type: ignore[arg-type]  # PEFT's scale alpha / r takes a float
        lora_dropout=0.0 if parameters else config.lora.dropout,
        target_modules=modules or None,
        target_parameters=parameters or None,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model,
    )
    return lora.to_dict()


_MODULES = {"linear_qkv": ["q_proj", "k_proj", "v_proj"], "linear_proj": ["o_proj"]}
_PARAMETERS = {  # order matters: PEFT nests the wrappers in this order (see the module docstring)
    "router": "mlp.router.weight",
    "linear_fc1": "mlp.experts.gate_up_proj",
    "linear_fc2": "mlp.experts.down_proj",
}


def save_peft(
    adapters: Mapping[str, torch.Tensor],
    config: ModelConfig,
    path: str | os.PathLike,
    base_model: str | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write the PEFT adapter directory `path` (created; must not exist) of our full adapter tensors."""
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"{path} exists")
    cfg = peft_config(config, base_model)
    tensors = {k: v.detach().to("cpu", dtype, copy=True) for k, v in peft_tensors(adapters, config).items()}
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    serialisable = {k: sorted(v) if isinstance(v, set) else v for k, v in cfg.items()}
    (path / "adapter_config.json").write_text(json.dumps(serialisable, indent=2, default=str))
    return path
