"""benchmarks/bench_lora.py's CPU smoke test: its correctness checks pass (B = 0 leaves the logits bitwise the
base's; the merged weights compute the LoRA model's function, in fp32 and in bf16 against the fp32 LoRA
model), LoRA trains the adapters only, and the shared-base sync moves the adapters' bytes, fewer than the
merged export's."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_lora", ROOT / "benchmarks" / "bench_lora.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_bench_lora_small():
    bench = load_bench()
    args = [
        "--small",
        "--tokens",
        "256",
        "--doc-len",
        "128",
        "--vocab",
        "256",
        "--iters",
        "1",
        "--warmup",
        "0",
    ]
    out = bench.main(args)
    assert out["checks"]["zero_b_bitwise"] == 1.0 and out["checks"]["merged_rel_err"] < 1e-5
    assert out["checks"]["lora_rel_err"] == 0.0  # fp32: the LoRA model is its own exact reference
    full, lora = out["full"], out["lora"]
    assert full["trainable"] == full["params"] and 0 < lora["trainable"] < lora["params"]
    assert lora["params"] - lora["trainable"] == full["params"]  # the base: the full model's parameters
    assert lora["sync_shared_bytes"] == 4 * lora["trainable"] < lora["sync_merged_bytes"]


def test_bench_lora_merged_check_in_bf16():
    """In bf16 the merged weights' logits are judged against the fp32 LoRA model beside the bf16 LoRA
    model's own: both errors are rounding-sized (routing flips included), well above fp32's, and the
    merged one within the check's bound."""
    import argparse

    import torch

    bench = load_bench()
    args = argparse.Namespace(layers=2, rank=32, vocab=256, small=True)
    checks = bench.check(args, torch.device("cpu"), torch.bfloat16)
    assert checks["zero_b_bitwise"] == 1.0
    assert (
        1e-3 < checks["lora_rel_err"] and 1e-3 < checks["merged_rel_err"] <= 2 * checks["lora_rel_err"] + 1e-5
    )
