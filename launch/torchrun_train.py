"""Training entry point for any layout (torchrun): next-token training with the token-mean loss on
synthetic documents, through the whole parallel stack (pipeline stages, tensor / sequence / expert
parallel, the distributed optimizer).

    torchrun --nproc_per_node 4 launch/torchrun_train.py --config configs/layouts/tiny_tp2_pp2_cpu.yaml
    torchrun --nproc_per_node 8 launch/torchrun_train.py --config configs/layouts/gpt_oss_20b_8gpu.yaml \\
        run.steps=50 run.init_from_hf=/path/to/gpt-oss-20b

The layout is the config's `parallel` section (world size = tp x pp x dp; ep carved from dp x tp).
Weights: `run.init_from_hf` (each rank reads its slices) or a layout-independent random initialisation
seeded by `run.seed`. Documents: arithmetic progressions of token ids modulo the vocabulary (random start
and stride), so the loss falls as the model learns to continue them; each data-parallel rank draws its
own and packs them into micro-batches of `--token-budget` tokens. Rank 0 prints one JSON line per step
(loss, gradient norm, lr, skipped, tokens, seconds, tokens/s per GPU, peak GiB) and appends it to
`run.output_dir/train_metrics.jsonl`.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_gptoss.config import load_config
from megatron_gptoss.parallel.apply import parallelize
from megatron_gptoss.parallel.data_parallel import DistributedOptimizer, apply_data_parallel
from megatron_gptoss.parallel.dims import ParallelDims
from megatron_gptoss.parallel.loading import init_parallel, load_hf_parallel, materialize
from megatron_gptoss.parallel.pipeline import PipelineRunner, build_stage_model, stage_plans
from megatron_gptoss.rl.ppo_loss import loss_denominators


def synthetic_documents(step: int, replica: int, vocab: int, budget: int, micro_batches: int, seed: int):
    """Rows of arithmetic progressions (mod vocab) filling about `micro_batches` x `budget` tokens."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + replica)
    lengths: list[int] = []
    while sum(lengths) < micro_batches * budget * 3 // 4:
        lengths.append(int(torch.randint(max(2, budget // 8), max(3, budget // 2 + 1), (1,), generator=gen)))
    width = max(lengths)
    start = torch.randint(0, vocab, (len(lengths), 1), generator=gen)
    stride = torch.randint(1, 8, (len(lengths), 1), generator=gen)
    sequence = (start + stride * torch.arange(width + 1)) % vocab
    valid = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    return sequence[:, :-1] * valid, sequence[:, 1:] * valid, valid


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True, help="YAML of overrides (configs/)")
    parser.add_argument("--token-budget", type=int, default=4096, help="tokens per micro-batch")
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step per dp rank")
    parser.add_argument("--pipeline-layers", default="", help="layers per (virtual) stage, e.g. 5,6,6,7")
    parser.add_argument("overrides", nargs="*", help="section.field=value")
    args = parser.parse_args()
    cfg = load_config(args.config, args.overrides)

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    elif cfg.run.num_threads:
        torch.set_num_threads(cfg.run.num_threads)
    dist.init_process_group("nccl" if cuda else "gloo")
    dims = ParallelDims.build(cfg.parallel, cfg.model)
    dtype = getattr(torch, cfg.run.dtype)
    counts = [int(c) for c in args.pipeline_layers.split(",")] if args.pipeline_layers else None
    plans = stage_plans(dims, cfg.model.num_layers, counts)

    models = []
    for plan in plans:
        model = parallelize(build_stage_model(cfg.model, plan, dtype, "meta"), dims, cfg.parallel)
        materialize(model, device)
        models.append(apply_data_parallel(model, dims))
    if cfg.run.init_from_hf:
        load_hf_parallel(models, cfg.run.init_from_hf, dims, cfg.model)
    else:
        init_parallel(models, cfg.model, dims, cfg.run.seed)
    optimizer = DistributedOptimizer(
        models, cfg.optim, dims, cfg.run.steps, shard=cfg.parallel.use_distributed_optimizer
    )
    runner = PipelineRunner(models, plans, dims)

    out_dir = Path(cfg.run.output_dir)
    if dims.rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
    for step in range(cfg.run.steps):
        ids, targets, valid = synthetic_documents(
            step, dims.coord("dp"), cfg.model.vocab_size, args.token_budget, args.micro_batches, cfg.run.seed
        )
        mask_dev = valid.float().to(device)
        tokens = loss_denominators([mask_dev], dims.group("dp")).tokens

        def loss_fn(rows, logprobs, entropy, mask_dev=mask_dev, tokens=tokens):
            return -(logprobs * mask_dev[rows.to(device)]).sum() / tokens

        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        packed = runner.pack(ids, targets, valid, args.token_budget)
        loss = runner.forward_backward(packed, loss_fn)
        metrics = optimizer.step()
        dist.all_reduce(loss, group=dims.group("dp"))
        seconds = time.perf_counter() - start
        peak = torch.tensor(
            [torch.cuda.max_memory_allocated(device) if cuda else 0], dtype=torch.float64, device=device
        )
        for kind in ("dp", "mp"):
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=dims.group(kind))
        line = {
            "step": step,
            "train/loss": float(loss),
            **metrics,
            "train/tokens": tokens,
            "train/micro_batches": packed.num_micro_batches,
            "perf/step_s": seconds,
            "perf/tokens_per_s_per_gpu": tokens / seconds / dims.layout.world,
            "perf/peak_gib": float(peak) / 1024**3,
        }
        if dims.rank == 0:
            print(json.dumps(line), flush=True)
            with open(out_dir / "train_metrics.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
