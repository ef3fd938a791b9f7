"""Configuration of LoRA adapters: low-rank updates trained on a frozen base model."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_gptoss.errors import ConfigError

# The layers an adapter can wrap, by their Megatron names: fused QKV, attention output projection, router,
# expert fc1 ([gate; up], one adapter per expert) and expert fc2 (one adapter per expert).
LORA_TARGETS = ("linear_qkv", "linear_proj", "router", "linear_fc1", "linear_fc2")


def _default_targets() -> list[str]:
    return ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


@dataclass
class LoRAConfig:
    """A target layer y = W x + b becomes y = W x + b + (alpha / rank) * B A dropout(x), A [rank, in]
    random, B [out, rank] zero at initialisation; with rank > 0 every base parameter is frozen and only the
    adapters train."""

    # Rank of every adapter; 0 turns LoRA off (the whole model trains).
    rank: int = 0
    # Scale numerator: the adapter's output is multiplied by alpha / rank.
    alpha: float = 16.0
    # Dropout probability on the adapter's input (training only; 0 keeps the forward deterministic: with
    # dropout the learner's log-prob passes are noisy, and the engine/learner mismatch statistics with them).
    dropout: float = 0.0
    # Layers that get adapters, a subset of LORA_TARGETS (the router is left out by default).
    targets: list[str] = field(default_factory=_default_targets)

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        """alpha / rank (0 when LoRA is off)."""
        return self.alpha / self.rank if self.rank > 0 else 0.0

    def validate(self) -> None:
        if self.rank < 0:
            raise ConfigError(f"model.lora.rank must be >= 0 (0 turns LoRA off), got {self.rank}")
        if not self.alpha > 0:
            raise ConfigError(f"model.lora.alpha must be positive, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.lora.dropout must be in [0, 1), got {self.dropout}")
        unknown = sorted({t for t in self.targets if t not in LORA_TARGETS})
        if unknown:
            raise ConfigError(f"model.lora.targets has unknown layers {unknown}; choose from {LORA_TARGETS}")
        if len(set(self.targets)) != len(self.targets):
            raise ConfigError(f"model.lora.targets lists a layer twice: {self.targets}")
        if self.rank > 0 and not self.targets:
            raise ConfigError("model.lora.targets is empty while model.lora.rank > 0: nothing would train")
