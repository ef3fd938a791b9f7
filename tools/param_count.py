"""Total and active parameters of GPT-OSS model presets or of an HF checkpoint's config.json.

    python tools/param_count.py                      # every preset
    python tools/param_count.py gpt_oss_120b         # some presets
    python tools/param_count.py --hf /path/to/gpt-oss-20b

Counts use HF shapes (unpadded vocabulary). Active parameters are those one token uses: the
attention, router and norms of every layer, top-k experts, and the unembedding but not the
embedding (OpenAI's convention: 116.8B / 5.1B for gpt-oss-120b, 20.9B / 3.6B for gpt-oss-20b).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megatron_gptoss.config import MODEL_PRESETS, ModelConfig


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("presets", nargs="*", help=f"presets among {sorted(MODEL_PRESETS)} (default: all)")
    parser.add_argument("--hf", type=Path, help="an HF GPT-OSS directory (reads its config.json)")
    args = parser.parse_args(argv)
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
