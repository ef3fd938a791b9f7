"""Configuration of the embedded rollout engine's scheduler and paged KV cache, and the checks of how the
engine holds the experts (`rollout.expert_format`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_gptoss.errors import ConfigError

if TYPE_CHECKING:
    from megatron_gptoss.config.model import ModelConfig
    from megatron_gptoss.config.train import RolloutConfig

SCHEDULES = ("continuous", "static")
GRAPH_MODES = ("auto", "off", "padded")
# How the rollout engine holds the expert weights (`rollout.expert_format`).
ROLLOUT_EXPERT_FORMATS = ("bf16", "mxfp4")
# Values per MXFP4 block along an expert's input dimension.
_MXFP4_BLOCK = 32


@dataclass
class EmbeddedEngineConfig:
    """How the embedded engine batches requests and stores keys and values."""

    # "continuous": rows leave the batch when they finish and waiting prompts take their slots, prompts are
    # prefilled in chunks alongside decoding rows; "static": batches of `max_batch_slots` prompts, each
    # prefilled whole, decoding until its last row finishes (finished rows keep computing), then the next.
    schedule: str = "continuous"
    # Sequences decoded together at most (rows of one step).
    max_batch_slots: int = 256
    # Token positions per KV-cache block.
    block_size: int = 16
    # Tokens one continuous step computes at most: one per decoding row, the rest for prefill chunks; at
    # least `max_batch_slots`, so a prefilling row always advances.
    max_step_tokens: int = 2048
    # While rows decode, waiting sequences are admitted together: once `admit_batch` slots are free (or as
    # many as wait, when fewer), or once a slot has stood free for `admit_wait` steps. A step that prefills
    # costs more than a decode step nearly whatever its prompt tokens and builds no plan ahead, so one such
    # step for several prompts beats one for each; the decode steps between keep the next step planned
    # ahead. 0: max(1, max_batch_slots // 16); 1 admits a sequence as soon as a slot frees.
    admit_batch: int = 0
    admit_wait: int = 32
    # Blocks per layer group (full-attention layers, sliding-window layers); 0 sizes the cache to the
    # requests and grows it between steps when it runs short.
    kv_blocks: int = 0
    # Record each token's routed experts (top-k ids per layer) for router replay; off costs nothing.
    record_routing: bool = False
    # Decode steps from CUDA graphs bucketed by batch size: "auto" (on CUDA, where an engine rank's steps
    # call no collective: tensor and expert parallel 1), "off", or "padded"
    # (the bucketed buffers run eagerly: a check, on any device).
    cuda_graphs: str = "auto"
    # Largest decode batch replayed from a graph (larger steps run eagerly).
    cuda_graph_max_batch: int = 512
    # Largest step with prefill tokens (a prompt's chunk, alone or beside decoding rows) replayed from a
    # graph, every token a row of the paged decode kernel; larger steps, and steps whose prefill tokens see
    # more than `scheduler.FLAT_KEYS_PER_TOKEN` keys on average, run eagerly. 0: every such step runs eagerly.
    cuda_graph_max_tokens: int = 2048
    # A replayed decode step whose rows all go on launches the next one before the host reads its tokens:
    # the next step's token ids are the sampled ones on the device, so the device never waits for the host
    # between decode steps (a row that stopped has its extra token dropped). Off: each step's tokens are read
    # first.
    decode_ahead: bool = True

    def admit_slots(self) -> int:
        """Free slots that make waiting sequences due for admission while rows decode (`admit_batch`)."""
        return self.admit_batch or max(1, self.max_batch_slots // 16)

    def validate(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"embedded.schedule={self.schedule!r} not in {SCHEDULES}")
        for name in ("max_batch_slots", "block_size", "max_step_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"embedded.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("admit_batch", "admit_wait"):
            if getattr(self, name) < 0:
                raise ConfigError(f"embedded.{name} must be >= 0, got {getattr(self, name)}")
        if self.max_step_tokens < self.max_batch_slots:
            raise ConfigError(
                f"embedded.max_step_tokens ({self.max_step_tokens}) must be >= embedded.max_batch_slots "
                f"({self.max_batch_slots}): every decoding row takes one token of a step"
            )
        if self.cuda_graphs not in GRAPH_MODES:
            raise ConfigError(f"embedded.cuda_graphs={self.cuda_graphs!r} not in {GRAPH_MODES}")
        if self.cuda_graph_max_batch < 1:
            raise ConfigError(f"embedded.cuda_graph_max_batch must be >= 1, got {self.cuda_graph_max_batch}")
        if self.cuda_graph_max_tokens < 0:
            raise ConfigError(
                f"embedded.cuda_graph_max_tokens must be >= 0, got {self.cuda_graph_max_tokens}"
            )
        if self.kv_blocks < 0:
            raise ConfigError(f"embedded.kv_blocks must be >= 0, got {self.kv_blocks}")


def check_rollout_expert_format(rollout: RolloutConfig, model: ModelConfig) -> None:
    """`rollout.expert_format: mxfp4` (the embedded engine holds MXFP4 experts, re-quantized by the bridge
    at every weight sync while the learner trains in its dtype) needs the embedded engine (vLLM would need
    its MXFP4 MoE path fed packed weights at every sync: refused), expert input widths that are multiples of
    32, and no bitwise on-policy mode (quantized experts are not the learner's). Raises ConfigError naming
    the setting."""
    if rollout.expert_format not in ROLLOUT_EXPERT_FORMATS:
        raise ConfigError(f"rollout.expert_format={rollout.expert_format!r} not in {ROLLOUT_EXPERT_FORMATS}")
    if rollout.expert_format != "mxfp4":
        return
    if rollout.engine != "embedded":
        raise ConfigError(
            f"rollout.expert_format='mxfp4' needs rollout.engine='embedded', got {rollout.engine!r}: the "
            "bridge does not feed vLLM's MXFP4 experts (use rollout.expert_format='bf16' with vLLM)"
        )
    if rollout.bitwise_on_policy:
        raise ConfigError(
            "rollout.bitwise_on_policy=true needs the engine to hold the learner's weights: "
            "rollout.expert_format='mxfp4' holds them quantized (set it to 'bf16')"
        )
    for name in ("hidden_size", "intermediate_size"):  # the experts' input widths
        if getattr(model, name) % _MXFP4_BLOCK:
            raise ConfigError(
                f"rollout.expert_format='mxfp4' quantizes the experts' inputs in blocks of {_MXFP4_BLOCK}: "
                f"model.{name}={getattr(model, name)} is not a multiple of it"
            )
