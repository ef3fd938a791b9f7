"""Context-parallel training step: one document of N tokens per context-parallel group, two gpt-oss-120b
layers (sliding + full: hidden 2880, 64 query / 8 KV heads, 128 experts top-4), bf16 parameters,
activation checkpointing, forward + backward (no optimizer), 2 GPUs with NCCL.

    torchrun --nproc_per_node 2 benchmarks/bench_context_parallel.py --cp 2 --tokens 131072
    torchrun --nproc_per_node 2 benchmarks/bench_context_parallel.py --small --cp 2   # CPU smoke test (gloo)

Layouts on 2 GPUs, experts over both (ep 2): cp 1 is dp 2 (each GPU trains its own document of N tokens);
cp 2 is one document of N tokens split over the two GPUs in zig-zag chunks, experts carved from the cp
ranks. Model FLOPs per GPU = `bench_train.step_flops` of the group's document / cp; the step is the median
of --iters after --warmup. One (cp, N) per process: a rank out of memory ends the run (torchrun stops
the other), so the longest document that trains is found by a loop over N in the shell (the table's
command in benchmarks/RESULTS.md). The result is one JSON line (appended to --out).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "tools"))  # a user tool: estimate_memory
from bench_train import model_config, step_flops, world_max  # noqa: E402
from bench_train_peer import time_steps, timing_summary  # noqa: E402
from estimate_memory import GIB, Layout, estimate  # noqa: E402

from megatron_gptoss.config import ParallelConfig  # noqa: E402
from megatron_gptoss.parallel.apply import parallelize  # noqa: E402
from megatron_gptoss.parallel.data_parallel import apply_data_parallel  # noqa: E402
from megatron_gptoss.parallel.dims import ParallelDims  # noqa: E402
from megatron_gptoss.parallel.loading import init_parallel, materialize  # noqa: E402
from megatron_gptoss.parallel.pipeline import PipelineRunner, StagePlan, build_stage_model  # noqa: E402
from megatron_gptoss.rl.ppo_loss import loss_denominators  # noqa: E402
from megatron_gptoss.utils.host import set_host_threads, to_device  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cp", type=int, default=2, help="context parallel size (1 or the world size)")
    parser.add_argument("--tokens", type=int, default=None, help="document length N (32768; --small 512)")
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--no-recompute", action="store_true", help="keep every layer's activations")
    parser.add_argument("--small", action="store_true", help="tiny widths on the CPU (gloo)")
    parser.add_argument("--out", default="", help="append the result as a JSON line to this file")
    args = parser.parse_args()
    if args.tokens is None:
        args.tokens = 512 if args.small else 32768

    cuda = torch.cuda.is_available() and not args.small
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    set_host_threads(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size()
    config = model_config(args)
    config = dataclasses.replace(config, activation_checkpointing=not args.no_recompute)
    pcfg = ParallelConfig(context_parallel_size=args.cp, expert_model_parallel_size=world)
    dims = ParallelDims.build(pcfg, config)
    plan = StagePlan(0, 1, range(config.num_layers))
    log = print if dims.rank == 0 else (lambda *a, **k: None)
    model = parallelize(build_stage_model(config, plan, torch.bfloat16, "meta"), dims, pcfg)
    materialize(model, device)
    model = apply_data_parallel(model, dims)
    init_parallel([model], config, dims, seed=0)
    model.train()

    n = args.tokens
    gen = torch.Generator().manual_seed(1000 + dims.coord("dp"))
    ids = torch.randint(0, config.vocab_size, (1, n), generator=gen)
    targets = torch.randint(0, config.vocab_size, (1, n), generator=gen)
    valid = torch.ones(ids.shape, dtype=torch.bool)
    mask_dev = valid.float().to(device)
    runner = PipelineRunner([model], [plan], dims)
    packed = runner.pack(ids, targets, valid, n)
    tokens = loss_denominators([mask_dev], dims.group("dp")).tokens

    def loss_fn(rows, lp, ent):
        return -(lp * mask_dev[to_device(rows, device)]).sum() / tokens

    def step() -> None:
        runner.forward_backward(packed, loss_fn)

    def zero() -> None:
        model.zero_grad(set_to_none=True)

    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    align = dist.barrier if world > 1 else None
    times = time_steps(step, args.warmup, args.iters, device, prepare=zero, align=align)
    summary = timing_summary(times)
    median = world_max(summary["median_s"], dims, device)
    peak = world_max(torch.cuda.max_memory_allocated(device) if cuda else 0.0, dims, device)
    layout = Layout(world, 1, 1, world, cp=args.cp)
    predicted = estimate(config, layout, n, optimizer=False, activation_checkpointing=not args.no_recompute)
    flops = step_flops(config, [n]) / args.cp
    result = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "gpus": world,
        "layout": f"cp{args.cp} ep{world} dp{dims.dp}",
        "doc_tokens": n,
        "activation_checkpointing": not args.no_recompute,
        "fwd_bwd_ms": median * 1e3,
        "fwd_bwd_spread_pct": summary["spread_pct"],
        "model_tflops_per_gpu": flops / median / 1e12,
        "peak_gib": peak / GIB,
        "estimated_gib": predicted["total"] / GIB,
        "attention_backend": config.attention_backend,
    }
    log(json.dumps(result), flush=True)
    if dims.rank == 0 and args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(result) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
