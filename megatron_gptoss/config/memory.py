"""Lower bounds of the memory one rank of a run takes, from its config alone (plain arithmetic, no torch).

    learner        the policy's parameters (run.dtype), fp32 gradients and AdamW state (12 bytes a parameter
                   with bf16 parameters: fp32 master weights and two moments; 8 with fp32 ones); with LoRA
                   the frozen base only (its experts at 4.25 bits a value with model.expert_format mxfp4)
    engine         the embedded engine's own copy of the weights (rollout.dtype); not counted with LoRA
                   (its engine may share the learner's base)
    kv_cache       the embedded engine's paged KV cache as the engine sizes it (`kv_cache_bytes`) for the
                   rows one engine replica generates at once, of one prompt token plus
                   rollout.max_new_tokens (longer prompts take more)

Every part is divided by the world size (the whole run's bytes spread evenly over its ranks), so the
largest rank holds at least this much: a run over the bound cannot fit, one under it may still not.
`tools/estimate_memory.py` prints the same KV-cache arithmetic beside its per-layout training estimate.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from megatron_gptoss.config.model import ModelConfig
from megatron_gptoss.errors import ConfigError

if TYPE_CHECKING:
    from megatron_gptoss.config.train import TrainConfig

GIB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def window_row_blocks(window: int, chunk: int, block_size: int) -> int:
    """KV blocks a sliding-window layer group holds for one row at most: its window plus a prefill chunk of
    `chunk` tokens (the row's quota there, at most its whole length)."""
    return math.ceil((window - 1 + chunk) / block_size) + 1


def pool_blocks(
    rows: int,
    tokens: int,
    prompt_tokens: int,
    window: int | None,
    *,
    block_size: int,
    max_step_tokens: int,
    kv_blocks: int,
    max_batch_slots: int,
    static: bool = False,
) -> int:
    """Blocks (null block included) of one pool of the embedded engine's cache made for `rows` sequences of
    up to `tokens` tokens, the longest prompt `prompt_tokens`. A full-attention pool (`window` None):
    `kv_blocks` (0: rows x ceil(tokens / block_size) + 1, sized to the requests). A sliding-window pool,
    where less: its rows' windows with their first prefill chunk (the longest prompt's, at most
    `max_step_tokens`, whole in the `static` schedule; with `kv_blocks`, `max_batch_slots` rows of any chunk
    up to a whole step's)."""
    blocks = kv_blocks or rows * math.ceil(tokens / block_size) + 1
    if window is None:
        return blocks
    if kv_blocks:
        chunk, window_rows = max(max_step_tokens, prompt_tokens if static else 0), max_batch_slots
    else:
        chunk, window_rows = prompt_tokens if static else min(prompt_tokens, max_step_tokens), rows
    return min(blocks, window_rows * window_row_blocks(window, chunk, block_size) + 1)


def kv_cache_bytes(
    model: ModelConfig,
    rows: int,
    tokens: int,
    *,
    dtype_bytes: int,
    block_size: int = 16,
    max_step_tokens: int = 2048,
    kv_heads: int | None = None,
    kv_blocks: int = 0,
    max_batch_slots: int = 256,
    prompt_tokens: int = 1,
) -> int:
    """Bytes of the embedded engine's paged KV cache (keys and values of every layer) when the continuous
    schedule makes it for `rows` sequences of up to `tokens` tokens each, the longest prompt
    `prompt_tokens`: `kv_blocks` blocks per full-attention layer (0: rows x ceil(tokens / block_size) + 1,
    sized to the requests), and per sliding-window layer, when that is less, the blocks that the rows'
    windows hold with their first prefill chunk (the longest prompt's, at most `max_step_tokens`; with
    `kv_blocks`, `max_batch_slots` rows of a whole step's chunk). `kv_heads`: the heads this engine shard
    caches (default all of the model's KV heads)."""
    heads = model.num_query_groups if kv_heads is None else kv_heads
    per_block_layer = 2 * block_size * heads * model.head_dim * dtype_bytes
    total = 0
    for layer in range(model.num_layers):
        blocks = pool_blocks(
            rows, tokens, prompt_tokens, model.window_of(layer), block_size=block_size,
            max_step_tokens=max_step_tokens, kv_blocks=kv_blocks, max_batch_slots=max_batch_slots,
        )  # fmt: skip
        total += max(blocks, 2) * per_block_layer
    return total


def learner_bytes(cfg: TrainConfig) -> int:
    """The whole run's learner parameters, gradients and optimizer state (module docstring)."""
    params = cfg.model.param_counts()["total"]
    weight = DTYPE_BYTES[cfg.run.dtype]
    if cfg.model.lora.enabled:  # the base is frozen: no gradient, no optimizer state (adapters not counted)
        return int(cfg.model.weight_bytes(weight))  # MXFP4 experts: 4.25 bits a value
    optimizer = 12 if weight < 4 else 8
    return params * (weight + 4 + optimizer)


def run_memory(cfg: TrainConfig, world: int) -> dict[str, float]:
    """Lower bounds, in bytes, of what the largest of `world` ranks holds (module docstring): `learner`,
    `engine`, `kv_cache`, `total`, and `kv_rows` / `kv_tokens`, the rows and tokens the cache is made for."""
    params = cfg.model.param_counts()["total"]
    parts: dict[str, float] = {"learner": learner_bytes(cfg) / world, "engine": 0.0, "kv_cache": 0.0}
    rollout, embedded = cfg.rollout, cfg.embedded
    rows = tokens = 0
    if cfg.run.mode == "rl" and rollout.engine == "embedded":
        if not cfg.model.lora.enabled:  # a LoRA engine may share the learner's base: not counted
            parts["engine"] = params * DTYPE_BYTES[rollout.dtype] / world
        replicas = max(1, world // rollout.tensor_parallel_size)
        batch = rollout.prompts_per_step * rollout.n_samples_per_prompt
        rows = min(math.ceil(batch / replicas), embedded.max_batch_slots)
        if cfg.agent.enabled:  # agent sessions: the cache is made for every slot
            rows = embedded.max_batch_slots
        tokens = 1 + rollout.max_new_tokens
        cache = kv_cache_bytes(
            cfg.model,
            rows,
            tokens,
            dtype_bytes=DTYPE_BYTES[rollout.dtype],
            block_size=embedded.block_size,
            max_step_tokens=embedded.max_step_tokens,
            kv_blocks=embedded.kv_blocks,
            max_batch_slots=embedded.max_batch_slots,
        )
        parts["kv_cache"] = cache / rollout.tensor_parallel_size
    parts["total"] = parts["learner"] + parts["engine"] + parts["kv_cache"]
    parts["kv_rows"], parts["kv_tokens"] = rows, tokens
    return parts


def check_fits(cfg: TrainConfig, world: int, capacity: float, where: str) -> None:
    """ConfigError with the estimate when the lower bound of `run_memory` exceeds `capacity` bytes (`where`:
    what holds them, e.g. "the host memory of this rank")."""
    parts = run_memory(cfg, world)
    if parts["total"] <= capacity:
        return
    kv = ""
    if parts["kv_cache"]:
        kv = f" for {int(parts['kv_rows'])} rows of up to {int(parts['kv_tokens'])} tokens"
    raise ConfigError(
        f"this run needs at least {parts['total'] / GIB:.3g} GiB per rank over {world} rank(s) (learner "
        f"{parts['learner'] / GIB:.3g} GiB: parameters, gradients, optimizer state; engine weights "
        f"{parts['engine'] / GIB:.3g} GiB; engine KV cache {parts['kv_cache'] / GIB:.3g} GiB{kv}), more than "
        f"{where} ({capacity / GIB:.3g} GiB). Lower rollout.max_new_tokens, rollout.prompts_per_step x "
        "rollout.n_samples_per_prompt or embedded.max_batch_slots, pick a smaller model, or use more ranks"
    )
