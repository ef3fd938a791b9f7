"""Training-step benchmark of two gpt-oss-120b layers (sliding + full: hidden 2880, 64 query / 8 KV heads,
all 128 experts, top-4) on 1, 2 or 4 GPUs with NCCL, bf16 parameters.

    torchrun --nproc_per_node 1 benchmarks/bench_train.py
    torchrun --nproc_per_node 4 benchmarks/bench_train.py              # experts split over the 4 GPUs
    torchrun --nproc_per_node 2 benchmarks/bench_train.py --small      # a CPU smoke test (gloo, 1024 tokens)
    torchrun --nproc_per_node 1 benchmarks/bench_train.py --no-optimizer --peer torchtitan

With `--peer torchtitan` (one GPU, tp 1) the same invocation then times torchtitan's GPT-OSS at the same
shapes and tokens (`benchmarks/bench_train_peer.py`: pinned version, wheels, its gradient defect) and prints
both medians, their spreads and the ratio as one table.

Layout: expert parallel over all GPUs (ep = world, unless --ep), dense parts data parallel, tp --tp.
Each tensor-parallel group trains on --tokens tokens: documents of --doc-len tokens packed into one
micro-batch (the group's tp GPUs share them: per-GPU rates divide by tp). The block
is embedding -> 2 layers -> final norm -> output layer of a --vocab vocabulary (the loss needs a head;
it is small next to the layers and counted in the FLOPs).

Steps: (1) the token-mean loss of the bf16 model against an fp32 copy of the same weights on the same
data (forward); (2) forward + backward timed; (3) the optimizer step (distributed optimizer: gradient
reduce-scatter, global norm, AdamW on fp32 master shards, all-gather) timed separately, when its state
fits (tools/estimate_memory.py decides); (4) peak memory against the estimate.

Model FLOPs per GPU per step (forward + backward = 3 x forward; a tp group's FLOPs over its tp GPUs), per
layer and token:
    dense   2 * (H (Hq + 2 Hkv) d + Hq d H + E H + k (2 I H + I H))       active parameters, top-k experts
    head    2 * H V (once, not per layer)
    attention 4 * Hq * d * (query-key pairs visible) per document and layer: QK^T and PV; a full layer
            sees n (n + 1) / 2 pairs in a document of n tokens, a sliding layer sum_i min(i + 1, W)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "tools"))  # a user tool: estimate_memory
from bench_train_peer import PEER_DEFECT, TORCHTITAN_VERSION, run_peer, time_steps, timing_summary  # noqa: E402
from estimate_memory import GIB, Layout, estimate  # noqa: E402
from step_probe import StepProbe  # noqa: E402

from megatron_gptoss.config import OptimConfig, ParallelConfig, gpt_oss_120b  # noqa: E402
from megatron_gptoss.ops import batch_invariant
from megatron_gptoss.parallel.apply import parallelize  # noqa: E402
from megatron_gptoss.parallel.data_parallel import DistributedOptimizer, apply_data_parallel  # noqa: E402
from megatron_gptoss.parallel.dims import ParallelDims  # noqa: E402
from megatron_gptoss.parallel.loading import init_parallel, materialize  # noqa: E402
from megatron_gptoss.parallel.pipeline import PipelineRunner, StagePlan, build_stage_model  # noqa: E402
from megatron_gptoss.rl.ppo_loss import loss_denominators  # noqa: E402
from megatron_gptoss.utils.host import set_host_threads, to_device  # noqa: E402


def model_config(args):
    if args.small:
        return gpt_oss_120b(
            num_layers=2,
            vocab_size=args.vocab,
            hidden_size=128,
            intermediate_size=128,
            num_attention_heads=8,
            num_query_groups=2,
            head_dim=32,
            num_experts=8,
            sliding_window=16,
            attention_backend="eager",
        )
    return gpt_oss_120b(num_layers=2, vocab_size=args.vocab)


def step_flops(config, docs: list[int]) -> float:
    """Model FLOPs of forward + backward over `docs` (document lengths), by the formula above."""
    h, i, e, k, d = (
        config.hidden_size,
        config.intermediate_size,
        config.num_experts,
        config.moe_router_topk,
        config.head_dim,
    )
    q, kv = config.num_attention_heads, config.num_query_groups
    tokens = sum(docs)
    dense = 2 * (h * (q + 2 * kv) * d + q * d * h + e * h + k * 3 * i * h) * tokens * config.num_layers
    head = 2 * h * config.vocab_size * tokens
    attention = 0.0
    for layer in range(config.num_layers):
        window = config.window_of(layer)
        for n in docs:
            if window is None or window >= n:
                pairs = n * (n + 1) / 2
            else:
                pairs = window * (window + 1) / 2 + (n - window) * window
            attention += 4 * q * d * pairs
    return 3 * (dense + head + attention)


def world_max(value: float, dims: ParallelDims, device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    for kind in ("dp", "mp"):
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=dims.group(kind))
    return float(t)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=None, help="tokens per GPU (16384; --small 1024)")
    parser.add_argument("--doc-len", type=int, default=None, help="document length (4096; --small 256)")
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=0, help="expert parallel size (0: the world size)")
    parser.add_argument(
        "--dispatch-chunks", type=int, default=1, help="expert parallel: tokens per layer in this many chunks"
    )
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-optimizer", action="store_true")
    parser.add_argument("--small", action="store_true", help="tiny widths on the CPU (gloo)")
    parser.add_argument("--out", default="", help="append the result as a JSON line to this file")
    parser.add_argument("--profile", action="store_true", help="print the top GPU kernels of one step")
    parser.add_argument("--trace", default="", help="with --profile: write the step's Chrome trace here")
    parser.add_argument(
        "--bitwise", action="store_true", help="batch-invariant forward kernels (rollout.bitwise_on_policy)"
    )
    parser.add_argument(
        "--peer", choices=["torchtitan"], default=None, help="also time this peer's GPT-OSS (one GPU, tp 1)"
    )
    args = parser.parse_args()
    if args.tokens is None:  # --small runs eager attention on the CPU: its [T, T] scores bound the documents
        args.tokens = 1024 if args.small else 16384
    if args.doc_len is None:
        args.doc_len = 256 if args.small else 4096
    batch_invariant.set_enabled(args.bitwise)
    if args.peer and (int(os.environ.get("WORLD_SIZE", "1")) != 1 or args.tp != 1):
        parser.error("--peer runs on one process with --tp 1 (the peer is timed unsharded)")

    cuda = torch.cuda.is_available() and not args.small
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    threads = set_host_threads(device)  # the trainer's default: see utils.host.set_host_threads
    dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size()
    if dist.get_rank() == 0:
        print(f"torch intra-op threads: {torch.get_num_threads()} ({'set' if threads else 'default'})")
    config = model_config(args)
    pcfg = ParallelConfig(
        tensor_model_parallel_size=args.tp,
        expert_model_parallel_size=args.ep or world,
        sequence_parallel=args.tp > 1,
        use_distributed_optimizer=True,
        expert_dispatch_chunks=args.dispatch_chunks,
    )
    dims = ParallelDims.build(pcfg, config)
    plan = StagePlan(0, 1, range(config.num_layers))
    log = print if dims.rank == 0 else (lambda *a, **k: None)

    def build(dtype):
        model = parallelize(build_stage_model(config, plan, dtype, "meta"), dims, pcfg)
        materialize(model, device)
        return apply_data_parallel(model, dims)

    model = build(torch.bfloat16)
    init_parallel([model], config, dims, seed=0)

    # data: this rank's documents, one packed micro-batch
    gen = torch.Generator().manual_seed(1000 + dims.coord("dp"))
    docs = [args.doc_len] * (args.tokens // args.doc_len)
    ids = torch.randint(0, config.vocab_size, (len(docs), args.doc_len), generator=gen)
    targets = torch.randint(0, config.vocab_size, (len(docs), args.doc_len), generator=gen)
    valid = torch.ones(ids.shape, dtype=torch.bool)
    mask = valid.float()
    runner = PipelineRunner([model], [plan], dims)
    packed = runner.pack(ids, targets, valid, args.tokens)
    mask_dev = mask.to(device)
    tokens = loss_denominators([mask_dev], dims.group("dp")).tokens

    def loss_fn(rows, lp, ent):
        return -(lp * mask_dev[to_device(rows, device)]).sum() / tokens

    # (1) bf16 loss against fp32 on the same weights
    def eval_loss(r: PipelineRunner) -> float:
        lp, _ = r.logprobs(packed)
        loss = -(lp.float() * mask_dev).sum() / tokens
        dist.all_reduce(loss, group=dims.group("dp"))
        return float(loss)

    loss_bf16 = eval_loss(runner)
    reference = build(torch.float32)
    with torch.no_grad():
        for p32, p16 in zip(reference.parameters(), model.parameters()):
            p32.copy_(p16)
    loss_fp32 = eval_loss(PipelineRunner([reference], [plan], dims))
    del reference
    if cuda:
        torch.cuda.empty_cache()
    loss_err = abs(loss_bf16 - loss_fp32) / abs(loss_fp32)
    log(f"loss bf16 {loss_bf16:.5f} fp32 {loss_fp32:.5f} rel diff {loss_err:.2e}", flush=True)

    # (3) does the optimizer state fit?
    layout = Layout(world, args.tp, 1, args.ep or world, sequence_parallel=args.tp > 1)
    predicted = estimate(config, layout, args.tokens, optimizer=not args.no_optimizer)
    capacity = torch.cuda.get_device_properties(device).total_memory if cuda else float("inf")
    opt = None
    if not args.no_optimizer and predicted["total"] < 0.95 * capacity:
        opt = DistributedOptimizer([model], OptimConfig(lr=1e-5), dims, total_steps=1000, shard=True)
    elif not args.no_optimizer:
        log(
            f"optimizer not built: estimated {predicted['total'] / GIB:.1f} GiB per GPU with its state "
            f"exceeds 95% of {capacity / GIB:.1f} GiB; timing forward + backward only",
            flush=True,
        )
        predicted = estimate(config, layout, args.tokens, optimizer=False)

    def zero() -> None:
        if opt is not None:
            opt.zero_grad()
        else:
            model.zero_grad(set_to_none=True)

    # (2) forward + backward
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)

    def fwd_bwd_step() -> None:
        runner.forward_backward(packed, loss_fn)

    align = dist.barrier if world > 1 else None  # every rank's step starts together
    probe = StepProbe(device)
    step_times = time_steps(
        fwd_bwd_step, args.warmup, args.iters, device, prepare=zero, align=align, probe=probe
    )
    ours = timing_summary(step_times)
    probe.report(step_times, "ours: forward + backward", print_fn=log)
    fwd_bwd = world_max(ours["median_s"], dims, device)

    # (3) optimizer step, gradients from one more backward before each
    opt_times = []
    if opt is not None:
        metrics: dict[str, float] = {}

        def fresh_grads() -> None:
            zero()
            runner.forward_backward(packed, loss_fn)

        def opt_step_timed() -> None:
            metrics.update(opt.step())

        opt_times = time_steps(
            opt_step_timed, 1, max(args.iters // 2, 2), device, prepare=fresh_grads, align=align
        )
        assert metrics["train/skipped"] == 0.0, metrics
    opt_step = world_max(statistics.median(opt_times), dims, device) if opt_times else float("nan")
    peak = world_max(torch.cuda.max_memory_allocated(device) if cuda else 0.0, dims, device)

    if args.profile and cuda:
        from torch.profiler import ProfilerActivity, profile

        zero()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            runner.forward_backward(packed, loss_fn)
            sync(device)
            wall = time.perf_counter() - start
        if args.trace and dims.rank == 0:
            prof.export_chrome_trace(args.trace)
        events = prof.key_averages()
        kernels = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA") / 1e3
        log(events.table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=60))
        log(
            f"profiled step: {wall * 1e3:.1f} ms wall (profiler on), {kernels:.1f} ms of GPU kernels",
            flush=True,
        )

    flops = step_flops(config, docs) / args.tp  # the tp group's GPUs share its documents
    result = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "gpus": world,
        "layout": f"tp{args.tp} ep{args.ep or world} dp{dims.dp}",
        "dispatch_chunks": args.dispatch_chunks,
        "tokens_per_gpu": args.tokens // args.tp,
        "doc_len": args.doc_len,
        "fwd_bwd_ms": fwd_bwd * 1e3,
        "fwd_bwd_spread_pct": ours["spread_pct"],
        "fwd_bwd_steps_ms": [round(t * 1e3, 2) for t in step_times],
        "optimizer_ms": opt_step * 1e3,
        "tokens_per_s_per_gpu": args.tokens / args.tp / fwd_bwd,
        "model_tflops_per_gpu": flops / fwd_bwd / 1e12,
        "model_tflops_per_gpu_with_optimizer": flops / (fwd_bwd + (opt_step if opt_times else 0.0)) / 1e12,
        "peak_gib": peak / GIB,
        "estimated_gib": predicted["total"] / GIB,
        "loss_bf16": loss_bf16,
        "loss_fp32": loss_fp32,
        "loss_rel_diff": loss_err,
        "attention_backend": config.attention_backend,
        "batch_invariant": args.bitwise,
    }
    if args.peer:
        del runner, model, opt
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        try:
            peer_probe = StepProbe(device)
            peer = run_peer(
                model_config=config, docs=docs, device=device, warmup=args.warmup, iters=args.iters,
                probe=peer_probe,
            )  # fmt: skip
            peer_probe.report([t / 1e3 for t in peer["steps_ms"]], "peer: forward + backward", print_fn=log)
        except Exception as exc:  # the peer is another project's code: report its failure, keep our result
            traceback.print_exc()
            result["peer"] = {"name": f"torchtitan {TORCHTITAN_VERSION}", "error": repr(exc)}
            print(f"peer torchtitan {TORCHTITAN_VERSION} did not run: {exc!r}", flush=True)
        else:
            result["peer"] = {"name": f"torchtitan {TORCHTITAN_VERSION}", **peer, "defect": PEER_DEFECT}
            print_peer_table(ours, peer, flops, args)
    if dims.rank == 0:
        print(json.dumps(result), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(result) + "\n")
    dist.destroy_process_group()


def print_peer_table(ours: dict, peer: dict, flops: float, args) -> None:
    """Our and the peer's forward + backward side by side: median, min-max, spread, model TF/s (the
    bench's FLOP formula for both), and the peer's time over ours (> 1: ours is faster)."""
    note = f"attention {peer['attention']}; {PEER_DEFECT}"
    if peer.get("torch_placeholders"):
        note += f"; placeholders for {', '.join(peer['torch_placeholders'])}"
    rows = [("megatron_gptoss", ours, ""), (f"torchtitan {TORCHTITAN_VERSION}", peer, note)]
    print(
        f"\nforward + backward, {args.tokens} tokens as {args.tokens // args.doc_len} x {args.doc_len} "
        f"packed, vocab {args.vocab}, median of {args.iters} steps after {args.warmup} warm-ups"
    )
    print("| model | median ms | min-max ms | spread | model TF/s | note |")
    print("|---|---|---|---|---|---|")
    for name, t, note in rows:
        print(
            f"| {name} | {t['median_s'] * 1e3:.1f} | {t['min_s'] * 1e3:.1f}-{t['max_s'] * 1e3:.1f} | "
            f"{t['spread_pct']:.1f}% | {flops / t['median_s'] / 1e12:.1f} | {note} |"
        )
    print(f"peer time / our time: {peer['median_s'] / ours['median_s']:.3f}", flush=True)


if __name__ == "__main__":
    main()
