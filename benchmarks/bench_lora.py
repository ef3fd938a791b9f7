"""LoRA against full-parameter training on gpt-oss-20b-width layers (hidden 2880, 64 query / 8 KV heads, 32
experts top-4, bf16) on one GPU: the training step's time and peak memory, and the weight sync's bytes and
time (the merged export a separate engine needs, against the adapter copy of an engine sharing the base).

    python benchmarks/bench_lora.py                       # 2 layers, rank 32, 8192 tokens
    python benchmarks/bench_lora.py --layers 4 --rank 16
    python benchmarks/bench_lora.py --small               # a CPU smoke test

Checks first (both must hold, else it exits non-zero): with B = 0 the LoRA model's logits equal the base
model's bit for bit; with trained-looking adapters (B random) the base model holding the merged weights
W + scale * B A computes the LoRA model's function: its logits are at most twice as far from the same LoRA
model's in fp32 (the exact function) as the LoRA model's own logits in the run's dtype, plus 1e-5 (both
relative errors printed). In fp32 that is a bound of 1e-5; in bf16 both errors are several percent, as a
rounding difference flips some tokens' top-4 experts of these random-weight layers.

Step: forward (hidden states, token log-probs of packed documents) + backward + AdamW (fp32 state) over the
trainable parameters: every parameter for "full", the adapters for "lora". Peak memory is the device's
peak during the timed steps (CUDA only). Sync: "merged" is the bridge's export of the HF tensors (what a
separate engine receives), "shared" the copy of the adapters into an engine's own (the base shared).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from megatron_gptoss.bridge.export import WeightExporter
from megatron_gptoss.bridge.plan import EngineLayout
from megatron_gptoss.config import gpt_oss_20b
from megatron_gptoss.config.lora import LoRAConfig
from megatron_gptoss.hf.convert import load_hf_tensors
from megatron_gptoss.model import GPTOSSModel
from megatron_gptoss.model.lora import adapters, base_config, is_adapter_param


def config_of(args, rank: int):
    lora = LoRAConfig(rank=rank, alpha=2.0 * rank) if rank else LoRAConfig()
    if args.small:
        return gpt_oss_20b(
            num_layers=args.layers, vocab_size=args.vocab, hidden_size=128, intermediate_size=128,
            num_attention_heads=8, num_query_groups=2, head_dim=16, num_experts=8,
            attention_backend="eager", max_position_embeddings=4096, lora=lora,
        )  # fmt: skip
    return gpt_oss_20b(num_layers=args.layers, vocab_size=args.vocab, lora=lora)


def build(config, device, dtype, seed: int = 0) -> GPTOSSModel:
    with torch.device(device):
        model = GPTOSSModel(config, dtype=dtype)
    return model.init_weights(torch.Generator().manual_seed(seed))


def batch(args, device):
    gen = torch.Generator().manual_seed(1)
    docs = args.tokens // args.doc_len
    ids = torch.randint(0, args.vocab, (1, docs * args.doc_len), generator=gen).to(device)
    targets = torch.randint(0, args.vocab, ids.shape, generator=gen).to(device)
    positions = torch.arange(args.doc_len).repeat(docs)[None].to(device)
    cu = torch.arange(0, docs * args.doc_len + 1, args.doc_len, dtype=torch.int32, device=device)
    return ids, targets, positions, cu


def sync_device(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check(args, device, dtype) -> dict[str, float]:
    """The two correctness checks of the module docstring."""
    ids = torch.randint(0, args.vocab, (1, 256), generator=torch.Generator().manual_seed(2)).to(device)
    lora, plain = build(config_of(args, args.rank), device, dtype), build(config_of(args, 0), device, dtype)
    with torch.no_grad():
        zero_b = torch.equal(lora(ids), plain(ids))
        gen = torch.Generator().manual_seed(3)
        for m in adapters(lora):
            m.b.copy_(torch.randn(m.b.shape, generator=gen).mul_(0.02).to(m.b))
        merged = dict(WeightExporter([lora], lora.config, None, EngineLayout(), 1 << 30).pairs())
        target = build(base_config(lora.config), device, dtype, seed=5)
        load_hf_tensors(target, target.config, merged.items())
        del merged, plain
        exact = build(lora.config, device, torch.float32)
        exact.load_state_dict(lora.state_dict())
        ref = exact(ids).double()
        del exact
        ours, theirs = lora(ids).double(), target(ids).double()
    return {
        "zero_b_bitwise": float(zero_b),
        "merged_rel_err": float((theirs - ref).norm() / ref.norm()),
        "lora_rel_err": float((ours - ref).norm() / ref.norm()),
    }


def bench_step(args, device, dtype, rank: int) -> dict[str, float]:
    model = build(config_of(args, rank), device, dtype)
    model.train()
    model.activation_checkpointing = args.recompute
    trainable = [p for p in model.parameters() if p.requires_grad]
    masters = [p.detach().float().clone().requires_grad_() for p in trainable]
    opt = torch.optim.AdamW(masters, lr=1e-5)
    ids, targets, positions, cu = batch(args, device)

    def step() -> None:
        hidden = model.hidden_states(ids, positions, cu, args.doc_len)
        lp, _ = model.token_logprobs(hidden, targets, 1.0, 4096)
        (-lp.float().mean()).backward()
        for p, m in zip(trainable, masters):
            m.grad = p.grad.float()
            p.grad = None
        opt.step()
        with torch.no_grad():
            for p, m in zip(trainable, masters):
                p.copy_(m)

    for _ in range(args.warmup):
        step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(args.iters):
        sync_device(device)
        start = time.perf_counter()
        step()
        sync_device(device)
        times.append(time.perf_counter() - start)
    out = {
        "step_ms": 1e3 * statistics.median(times),
        "trainable": float(sum(p.numel() for p in trainable)),
        "params": float(sum(p.numel() for p in model.parameters())),
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0,
    }
    if rank:
        out.update(bench_sync(model, device))
    return out


def bench_sync(model: GPTOSSModel, device) -> dict[str, float]:
    exporter = WeightExporter([model], model.config, None, EngineLayout(), 1 << 30)
    sync_device(device)
    start = time.perf_counter()
    merged = sum(t.numel() * t.element_size() for _, t in exporter.pairs())
    sync_device(device)
    merged_s = time.perf_counter() - start
    own = {n: torch.empty_like(p) for n, p in model.named_parameters() if is_adapter_param(n)}
    start = time.perf_counter()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in own:
                own[n].copy_(p)
    sync_device(device)
    shared_s = time.perf_counter() - start
    shared = sum(t.numel() * t.element_size() for t in own.values())
    return {"sync_merged_bytes": merged, "sync_merged_ms": 1e3 * merged_s,
            "sync_shared_bytes": shared, "sync_shared_ms": 1e3 * shared_s}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--doc-len", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--recompute", action="store_true", help="activation checkpointing per layer")
    parser.add_argument("--small", action="store_true", help="tiny widths on the CPU")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.small else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    checks = check(args, device, dtype)
    print(f"checks: B = 0 logits bitwise equal the base's: {bool(checks['zero_b_bitwise'])}; relative errors "
          f"to the fp32 LoRA model: merged weights {checks['merged_rel_err']:.2e}, LoRA in {dtype} "
          f"{checks['lora_rel_err']:.2e}")  # fmt: skip
    if not checks["zero_b_bitwise"] or checks["merged_rel_err"] > 2 * checks["lora_rel_err"] + 1e-5:
        raise SystemExit("correctness check failed")
    rows = {"full": bench_step(args, device, dtype, 0), "lora": bench_step(args, device, dtype, args.rank)}
    print(f"{'':6} {'step ms':>9} {'trainable':>12} {'peak GiB':>9}")
    for name, r in rows.items():
        print(f"{name:6} {r['step_ms']:9.1f} {r['trainable']:12.4g} {r['peak_gib']:9.2f}")
    lora = rows["lora"]
    merged_mib, shared_mib = lora["sync_merged_bytes"] / 2**20, lora["sync_shared_bytes"] / 2**20
    print(f"sync: merged {merged_mib:.1f} MiB in {lora['sync_merged_ms']:.1f} ms, "
          f"shared base {shared_mib:.2f} MiB in {lora['sync_shared_ms']:.2f} ms")  # fmt: skip
    result = {"device": str(device), "args": vars(args), "checks": checks, **rows}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
