"""The policy of a LoRA run rebuilt from its adapters-only checkpoint, in one process.

A LoRA checkpoint (`DistributedCheckpointer` with `model.lora.rank > 0`) stores the adapters and their
optimizer state, and in its manifest `base` where the frozen base comes from: an HF directory
(`{"init_from_hf": path}`) or the layout-independent random initialisation (`{"seed": s}`). `load_policy`
builds the whole model on this process (a world of one rank), fills the base from that source and the
adapters from the checkpoint: the model the run trained, adapters applied in its forward. `read_adapters`
reads the adapters alone (full tensors, fp32), without the base.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_gptoss.checkpoint.dist_boxes import Box, full_shapes
from megatron_gptoss.checkpoint.dist_planner import Target, load_pieces
from megatron_gptoss.checkpoint.distributed import DistributedCheckpointer
from megatron_gptoss.checkpoint.manager import CheckpointManager, read_manifest
from megatron_gptoss.config import ModelConfig, ParallelConfig
from megatron_gptoss.errors import CheckpointError
from megatron_gptoss.model.gpt_oss import GPTOSSModel
from megatron_gptoss.model.lora import is_adapter_param
from megatron_gptoss.parallel.apply import parallelize
from megatron_gptoss.parallel.dims import ParallelDims
from megatron_gptoss.parallel.loading import init_parallel, load_hf_parallel


def is_lora_checkpoint(manifest: dict[str, Any]) -> bool:
    return bool(manifest.get("contents", {}).get("adapters_only", False))


def load_policy(path: str | Path, dtype: torch.dtype = torch.float32) -> tuple[GPTOSSModel, ParallelDims]:
    """(model, its one-rank ParallelDims) of the LoRA checkpoint at `path`. Needs torch.distributed
    initialised with a world of one rank. Raises CheckpointError when the checkpoint is not a LoRA one or
    its base cannot be rebuilt."""
    path = Path(path)
    manifest = read_manifest(path)
    if not is_lora_checkpoint(manifest):
        raise CheckpointError(f"{path} is not a LoRA checkpoint (it stores the whole model)")
    if dist.get_world_size() != 1:
        raise CheckpointError(
            f"a LoRA checkpoint is rebuilt in one process, the world has {dist.get_world_size()}"
        )
    config = ModelConfig(**manifest["model"])
    run_config = manifest.get("config") or {}
    base = manifest.get("base") or {}
    dims = ParallelDims.build(ParallelConfig(), config)
    model = parallelize(GPTOSSModel(config, dtype=dtype), dims, ParallelConfig())
    assert isinstance(model, GPTOSSModel)
    with torch.no_grad():
        if "init_from_hf" in base:
            load_hf_parallel([model], base["init_from_hf"], dims, config)
        elif "seed" in base:
            init_parallel([model], config, dims, int(base["seed"]))
        else:
            raise CheckpointError(
                f"{path}: the manifest does not say where the LoRA base comes from ({base})"
            )
    world = dist.group.WORLD
    assert world is not None
    checkpointer = DistributedCheckpointer(
        CheckpointManager(path.parent), dims, config, world, run_config=run_config
    )
    checkpointer.load(path, {"model": [model]}, None)
    return model.eval(), dims


def read_adapters(path: str | Path) -> tuple[dict[str, torch.Tensor], ModelConfig, dict[str, Any]]:
    """(every adapter tensor of module group "model" at full shape in fp32, the model config, the manifest's
    `base`) of the LoRA checkpoint at `path`; collective over the default group (a world of one rank)."""
    path = Path(path)
    manifest = read_manifest(path)
    if not is_lora_checkpoint(manifest):
        raise CheckpointError(f"{path} is not a LoRA checkpoint (it stores the whole model)")
    config = ModelConfig(**manifest["model"])
    shapes = {n: s for n, s in full_shapes(config).items() if is_adapter_param(n)}
    tensors = {n: torch.empty(s, dtype=torch.float32) for n, s in shapes.items()}
    targets = [Target(f"model/{n}", Box((0,) * len(s), tuple(s)), tensors[n]) for n, s in shapes.items()]
    world = dist.group.WORLD
    assert world is not None
    load_pieces(path, targets, {t.fqn: shapes[t.fqn[len("model/") :]] for t in targets}, [], world)
    return tensors, config, manifest.get("base") or {}
