"""Total and active parameters of GPT-OSS model presets or of an HF checkpoint's config.json.

    python tools/param_count.py                      # every preset
    python tools/param_count.py gpt_oss_120b         # some presets
    python tools/param_count.py --hf /path/to/gpt-oss-20b
    python tools/param_count.py --config configs/gpt_oss_120b_lora_1gpu.yaml [a.b=value ...]

Counts use HF shapes (unpadded vocabulary). Active parameters are those one token uses: the
attention, router and norms of every layer, top-k experts, and the unembedding but not the
embedding (OpenAI's convention: 116.8B / 5.1B for gpt-oss-120b, 20.9B / 3.6B for gpt-oss-20b).
With --config, also the run's LoRA adapter parameters (`model.lora`; counted on the model built on the meta
device) and the model's weight bytes in the run's dtype, MXFP4 experts (`model.expert_format`) at 4.25 bits a
value.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megatron_gptoss.config import MODEL_PRESETS, ModelConfig, load_config
from megatron_gptoss.config.memory import DTYPE_BYTES
from megatron_gptoss.model import GPTOSSModel
from megatron_gptoss.model.lora import is_adapter_param


def human(count: int) -> str:
    """1.2345e11 -> '123.5B'; 3.6e9 -> '3.6B'; 44528 -> '44.5K'."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.1f}{unit}"
    return str(count)


def count_line(name: str, config: ModelConfig) -> str:
    counts = config.param_counts()
    return (
        f"{name:<16} total {human(counts['total']):>8}  active {human(counts['active']):>8}  "
        f"(embedding {human(counts['embedding'])}; exactly {counts['total']:,} / {counts['active']:,})"
    )


def adapter_params(config: ModelConfig) -> int:
    """Parameters of the LoRA adapters `config.lora` puts on the model (0 with LoRA off)."""
    model = GPTOSSModel(config, device="meta")
    return sum(p.numel() for name, p in model.named_parameters() if is_adapter_param(name))


def config_line(path: Path, overrides: list[str]) -> str:
    cfg = load_config(path, overrides)
    model, dtype = cfg.model, cfg.run.dtype
    weights = model.weight_bytes(DTYPE_BYTES[dtype]) / 2**30
    lora, count = model.lora, adapter_params(model)
    adapters = "no LoRA"
    if lora.enabled:
        adapters = f"LoRA rank {lora.rank} on {','.join(lora.targets)}: {human(count)} adapter parameters"
        adapters += f" (exactly {count:,})"
    experts = f"experts {model.expert_format}"
    return f"{count_line(path.name, model)}\n  weights {weights:.1f} GiB ({dtype}, {experts}); {adapters}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("presets", nargs="*", help=f"presets among {sorted(MODEL_PRESETS)} (default: all)")
    parser.add_argument("--hf", type=Path, help="an HF GPT-OSS directory (reads its config.json)")
    parser.add_argument("--config", type=Path, help="a run config (YAML); the positional arguments are then "
                        "its a.b=value overrides")  # fmt: skip
    args = parser.parse_args(argv)
    if args.config is not None:
        print(config_line(args.config, args.presets))
        return
    if args.hf is not None:
        config = ModelConfig.from_hf_config(json.loads((args.hf / "config.json").read_text()))
        print(count_line(args.hf.name, config))
    unknown = sorted(set(args.presets) - set(MODEL_PRESETS))
    if unknown:
        parser.error(f"unknown presets {unknown}; choose among {sorted(MODEL_PRESETS)}")
    for name in args.presets or ([] if args.hf else list(MODEL_PRESETS)):
        print(count_line(name, MODEL_PRESETS[name]()))


if __name__ == "__main__":
    main()
