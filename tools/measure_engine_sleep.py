"""The embedded engine's sleep levels measured on a GPU: device memory before, after `sleep(level)` and after
`wake_up()`, for gpt-oss-20b's width at --layers layers (bf16, random weights) with a KV cache sized by a
generation of --rows prompts of --prompt-len tokens.

    python tools/measure_engine_sleep.py [--layers 24] [--rows 64] [--prompt-len 512]
"""

from __future__ import annotations

import argparse

import torch

from megatron_gptoss.config import EmbeddedEngineConfig
from megatron_gptoss.config.model import MODEL_PRESETS
from megatron_gptoss.engine_api import SamplingParams
from megatron_gptoss.rollout.embedded import EmbeddedEngine


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("measure_engine_sleep needs a GPU (sleep moves device memory)")
    config = MODEL_PRESETS["gpt_oss_20b"](num_layers=args.layers)
    engine = EmbeddedEngine(
        config, torch.bfloat16, "cuda", 0, EmbeddedEngineConfig(max_batch_slots=args.rows)
    )
    with torch.no_grad():
        for p in engine.model.parameters():
            p.normal_(0, 0.02)
    prompts = [[(i * 7 + j) % 1000 + 1 for j in range(args.prompt_len)] for i in range(args.rows)]
    engine.generate(prompts, SamplingParams(max_new_tokens=4, seed=0))
    columns = [
        "level",
        "allocated before",
        "KV cache",
        "weights",
        "freed",
        "after sleep",
        "taken",
        "after wake",
    ]
    print("| " + " | ".join(columns) + " |  (GiB)")
    print("|" + "---|" * len(columns))
    for level in (1, 2):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        released = engine.sleep(level)
        after = torch.cuda.memory_allocated()
        taken = engine.wake_up()["device_bytes_taken"]
        woken = torch.cuda.memory_allocated()
        print(
            f"| {level} | {gib(before)} | {gib(released['kv_cache_bytes'])} "
            f"| {gib(released['weight_bytes'])} | {gib(released['device_bytes_freed'])} | {gib(after)} "
            f"| {gib(taken)} | {gib(woken)} |"
        )
        if level == 2:  # the weights must arrive again before generating
            with torch.no_grad():
                for p in engine.model.parameters():
                    p.normal_(0, 0.02)
            engine.memory.weights_loaded()
        engine.generate(prompts, SamplingParams(max_new_tokens=4, seed=0))


if __name__ == "__main__":
    main()
