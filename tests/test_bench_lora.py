"""tools/bench_lora.py's CPU smoke test: its correctness checks pass (B = 0 leaves the logits bitwise the
base's; LoRA equals the merged weights), LoRA trains the adapters only, and the shared-base sync moves the
adapters' bytes, fewer than the merged export's."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_lora_small():
    spec = importlib.util.spec_from_file_location("bench_lora", ROOT / "tools" / "bench_lora.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
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
    full, lora = out["full"], out["lora"]
    assert full["trainable"] == full["params"] and 0 < lora["trainable"] < lora["params"]
    assert lora["params"] - lora["trainable"] == full["params"]  # the base: the full model's parameters
    assert lora["sync_shared_bytes"] == 4 * lora["trainable"] < lora["sync_merged_bytes"]
