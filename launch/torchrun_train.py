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
(loss, gradient norm, lr, skipped, tokens, seconds, tokens/s per GPU, peak GiB) and logs it to
`run.output_dir/metrics.jsonl` (and TensorBoard).

Checkpoints (`checkpoint.distributed`): every `run.save_every` steps and at the end (none when negative),
under `run.output_dir/checkpoints` (the newest `run.keep_last` kept; `run.async_save` writes in the
background), each rank writing what it owns. `--resume auto` continues from the newest complete checkpoint
(exactly: the documents of a step depend only on the step and the seed), `--resume DIR` from that one; the
layout may differ from the checkpoint's. A graceful stop (SIGTERM or SIGUSR1 to the ranks, or the file
`--stop-file` appearing, which launch/slurm_train.sbatch creates before the time limit) saves a
checkpoint at the end of the current step and exits 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_gptoss.checkpoint.distributed import DistributedCheckpointer, RunState
from megatron_gptoss.config import load_config
from megatron_gptoss.parallel.apply import parallelize
from megatron_gptoss.parallel.data_parallel import DistributedOptimizer, apply_data_parallel
from megatron_gptoss.parallel.dims import ParallelDims
from megatron_gptoss.parallel.loading import init_parallel, load_hf_parallel, materialize
from megatron_gptoss.parallel.pipeline import PipelineRunner, build_stage_model, stage_plans
from megatron_gptoss.rl.ppo_loss import loss_denominators
from megatron_gptoss.utils.metrics import MetricsLogger


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


class StopRequest:
    """A graceful stop asked for by a signal to this rank or by `path` appearing; `agreed` is collective
    (every rank learns whether any rank was asked)."""

    def __init__(self, path: str, device: torch.device):
        self.path, self.device, self.asked = path, device, False
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._ask)

    def _ask(self, signum: int, frame: object) -> None:
        self.asked = True

    def agreed(self) -> bool:
        asked = self.asked or (bool(self.path) and os.path.exists(self.path))
        flag = torch.tensor([int(asked)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True, help="YAML of overrides (configs/)")
    parser.add_argument("--token-budget", type=int, default=4096, help="tokens per micro-batch")
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step per dp rank")
    parser.add_argument(
        "--pipeline-layers", default="", help="layers per (virtual) stage, e.g. 5,6,6,7 (pipeline_layers)"
    )
    parser.add_argument(
        "--resume", default=None, help='"auto" (newest complete checkpoint), a checkpoint directory or ""'
    )
    parser.add_argument("--stop-file", default="", help="stop gracefully (save, exit 0) once it exists")
    parser.add_argument("overrides", nargs="*", help="section.field=value")
    args = parser.parse_intermixed_args()  # overrides may come before or after the flags
    overrides = list(args.overrides)
    if args.pipeline_layers:
        overrides.append(f"parallel.pipeline_layers={args.pipeline_layers}")
    if args.resume is not None:
        overrides.append(f"run.resume={args.resume!r}")
    cfg = load_config(args.config, overrides)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    elif cfg.run.num_threads:
        torch.set_num_threads(cfg.run.num_threads)
    dist.init_process_group("nccl" if cuda else "gloo")
    dims = ParallelDims.build(cfg.parallel, cfg.model)
    dtype = getattr(torch, cfg.run.dtype)
    counts = cfg.parallel.pipeline_layers or None
    plans = stage_plans(dims, cfg.model.num_layers, counts)

    models = []
    for plan in plans:
        model = parallelize(build_stage_model(cfg.model, plan, dtype, "meta"), dims, cfg.parallel)
        materialize(model, device)
        models.append(apply_data_parallel(model, dims))
    modules = {"model": models}
    out_dir = Path(cfg.run.output_dir)
    checkpointer = DistributedCheckpointer.for_run(cfg, dims)
    found = checkpointer.locate(cfg.run.resume)
    if found is None:  # a checkpoint overwrites all of it
        if cfg.run.init_from_hf:
            load_hf_parallel(models, cfg.run.init_from_hf, dims, cfg.model)
        else:
            init_parallel(models, cfg.model, dims, cfg.run.seed)
    optimizer = DistributedOptimizer(
        models, cfg.optim, dims, cfg.run.steps, shard=cfg.parallel.use_distributed_optimizer
    )
    loaded = None if found is None else checkpointer.resume_from(found, modules, optimizer)
    first = loaded.run.step if loaded is not None else 0
    runner = PipelineRunner(models, plans, dims)
    stop = StopRequest(args.stop_file, device)
    logger = None
    if dims.rank == 0:
        logger = MetricsLogger(out_dir, tensorboard=cfg.run.tensorboard, resume_step=first)

    def save(step: int) -> None:
        run = RunState(step, data={"next_step": step}, metrics={"next_step": step})
        if cfg.run.async_save:
            checkpointer.save_async(step, modules, optimizer, run)
        else:
            checkpointer.save(step, modules, optimizer, run)

    step = first
    while step < cfg.run.steps:
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
            "train/loss": float(loss),
            **metrics,
            "train/tokens": tokens,
            "train/micro_batches": packed.num_micro_batches,
            "perf/step_s": seconds,
            "perf/tokens_per_s_per_gpu": tokens / seconds / dims.layout.world,
            "perf/peak_gib": float(peak) / 1024**3,
        }
        if logger is not None:
            print(json.dumps({"step": step, **logger.log(step, line)}), flush=True)
        step += 1
        stopping = stop.agreed()
        periodic = cfg.run.save_every > 0 and step % cfg.run.save_every == 0
        if periodic or stopping or (step == cfg.run.steps and cfg.run.save_every >= 0):
            save(step)
        if stopping:
            if dims.rank == 0:
                print(f"stop requested: step {step} saved; continue with --resume auto", flush=True)
            break
    checkpointer.wait()
    if logger is not None:
        logger.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
