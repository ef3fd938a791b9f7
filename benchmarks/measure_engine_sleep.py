"""The embedded engine's sleep levels measured on a GPU: device memory before, after `sleep(level)` and after
`wake_up()`, for gpt-oss-20b's width at --layers layers (bf16, random weights) with a KV cache sized by a
generation of --rows prompts of --prompt-len tokens.

    python benchmarks/measure_engine_sleep.py [--layers 24] [--rows 64] [--prompt-len 512]
"""

from __future__ import annotations

import argparse
import gc

import torch

from megatron_gptoss.config import EmbeddedEngineConfig
from megatron_gptoss.config.model import MODEL_PRESETS
from megatron_gptoss.engine_api import SamplingParams
from megatron_gptoss.rollout.embedded import EmbeddedEngine


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def explain(allocated: int, top: int = 12) -> None:
    """The largest CUDA tensors Python still reaches (storage sizes, deduplicated), against `allocated`."""
    storages: dict[int, tuple[int, str]] = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.is_cuda:
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = (storage.nbytes(), f"{tuple(obj.shape)} {obj.dtype}")
        except Exception:  # objects that fail isinstance or have no storage
            continue
    reached = sum(n for n, _ in storages.values())
    print(f"  live CUDA tensors reached from Python: {len(storages)}, {gib(reached)} GiB of {gib(allocated)}")
    for n, what in sorted(storages.values(), reverse=True)[:top]:
        print(f"    {n / 2**20:10.1f} MiB  {what}")
    largest = max(
        (o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.is_cuda),
        key=lambda t: t.untyped_storage().nbytes(),
        default=None,
    )
    if largest is not None:
        holders(largest, depth=8)
    unreachable = gc.collect()
    torch.cuda.empty_cache()
    print(f"  gc.collect(): {unreachable} objects, allocated then {gib(torch.cuda.memory_allocated())} GiB")


def holders(obj, depth: int, indent: str = "    ", seen: set[int] | None = None) -> None:
    """Print what refers to `obj`, `depth` levels up: types, dict keys, functions, frames (not followed)."""
    seen = set() if seen is None else seen
    if depth == 0:
        return
    for ref in gc.get_referrers(obj):
        if id(ref) in seen or ref is seen or isinstance(ref, type(gc.get_objects)):
            continue
        seen.add(id(ref))
        kind = type(ref).__name__
        if kind == "frame":
            print(f"{indent}<- frame {ref.f_code.co_name} {ref.f_code.co_filename}:{ref.f_lineno}")
            holders(ref, min(depth - 1, 4), indent + "  ", seen)
            continue
        if kind == "function":
            print(f"{indent}<- function {ref.__qualname__} ({ref.__code__.co_filename})")
        elif isinstance(ref, dict):
            keys = [k for k, v in ref.items() if v is obj][:3]
            print(f"{indent}<- dict key {keys} ({len(ref)} keys)")
        elif isinstance(ref, (list, tuple)):
            kinds = ", ".join(type(x).__name__ for x in list(ref)[:8])
            print(f"{indent}<- {kind} of {len(ref)} ({kinds})")
        elif isinstance(ref, BaseException):
            print(f"{indent}<- exception {type(ref).__name__}: {str(ref)[:200]}")
        else:
            print(f"{indent}<- {type(ref).__module__}.{type(ref).__qualname__}")
        holders(ref, depth - 1, indent + "  ", seen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--explain", action="store_true", help="list the live CUDA tensors after each sleep")
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
        if args.explain:
            explain(after)
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
