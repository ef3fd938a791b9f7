"""`parallelize`: the one place that turns a single-device GPT-OSS (or a pipeline stage of one) into this
rank's part of a parallel model, in a fixed order:

    1. tensor parallel   attention heads, vocab-parallel embedding and output layer, sequence parallel;
                         context parallel: attention over the cp ranks' zig-zag chunks of the tokens
    2. expert parallel   experts over ep, token dispatch, tokens split over tp
    3. activation checkpointing (per transformer layer)
    4. compile           the caller's `compile_fn`, applied to the parallel modules
    5. data parallel     each parameter tagged with the group its gradient is summed over (dp, or
                         edp for experts); `data_parallel.DistributedOptimizer` reduces and steps

Construction order of a parallel model: build the single-device model (CPU, or the meta device for big
models), `parallelize` it (each rank keeps only its shards, tagged with `ShardSpec`; weights already
present are kept as shards), then load weights into the shards (`sharding.local_shard` of full tensors).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from megatron_gptoss.config import ModelConfig, ParallelConfig
from megatron_gptoss.errors import LayoutError
from megatron_gptoss.parallel.context_parallel import apply_context_parallel
from megatron_gptoss.parallel.data_parallel import apply_data_parallel
from megatron_gptoss.parallel.dims import ParallelDims, validate_layout
from megatron_gptoss.parallel.expert_parallel import apply_expert_parallel
from megatron_gptoss.parallel.tensor_parallel import apply_tensor_parallel
from megatron_gptoss.parallel.vocab_parallel import apply_vocab_parallel


def apply_activation_checkpointing(model: nn.Module, enabled: bool) -> None:
    """Recompute each transformer layer (its collectives included) in the backward when `enabled`."""
    if not hasattr(model, "activation_checkpointing"):
        raise TypeError(f"{type(model).__name__} has no per-layer activation checkpointing switch")
    model.activation_checkpointing = enabled  # type: ignore[assignment]


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    cfg: ParallelConfig,
    *,
    compile_fn: Callable[[nn.Module], nn.Module] | None = None,
) -> nn.Module:
    """This rank's part of `model` under the layout `dims` (built from `cfg`). Modules are swapped in
    place; the returned module is the one to train.

    `model` must carry its `config` (a ModelConfig). A layout that does not divide the model (heads,
    KV heads, experts, layers, world size) raises LayoutError naming the numbers.
    """
    config = getattr(model, "config", None)
    if not isinstance(config, ModelConfig):
        raise TypeError(f"parallelize needs a model with a ModelConfig `config`, got {type(model).__name__}")
    layout = validate_layout(cfg, config, dims.layout.world)
    if layout != dims.layout or cfg.sequence_parallel != dims.sequence_parallel:
        raise LayoutError(
            f"the parallel config ({layout}, sequence_parallel={cfg.sequence_parallel}) differs from the "
            f"ParallelDims the process groups were built for ({dims.layout}, "
            f"sequence_parallel={dims.sequence_parallel})"
        )
    # 1. tensor parallel
    apply_tensor_parallel(model, config, dims)
    apply_vocab_parallel(model, config.padded_vocab_size(dims.tp), dims)
    apply_context_parallel(model, dims)
    # 2. expert parallel
    apply_expert_parallel(model, config, dims, cfg.expert_dispatch_chunks)
    # 3. activation checkpointing
    apply_activation_checkpointing(model, config.activation_checkpointing)
    # 4. compile
    if compile_fn is not None:
        model = compile_fn(model)
    # 5. data parallel
    return apply_data_parallel(model, dims)
