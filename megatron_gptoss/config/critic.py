"""Configuration of PPO's critic (the value model trained beside the policy when
`algorithm.advantage: gae`)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_gptoss.errors import ConfigError


@dataclass
class CriticConfig:
    """The value model: the policy's architecture and layout with a scalar head, initialised from the
    policy's weights at the start of the run or from `init_from_hf`, colocated with it,
    trained by its own optimizer (`optim`'s settings but for the learning rate and the clipping here) on the
    same mini-batches and epochs as the policy (`ppo.*`)."""

    # HF GPT-OSS directory the critic's body starts from ("": the policy's weights at the start of the run);
    # its model config must match `model`. The head starts from Normal(0, model.init_std) either way.
    init_from_hf: str = ""
    # Peak learning rate of the critic's optimizer (the schedule, warm-up, betas and decay are `optim`'s).
    lr: float = 1e-5
    # Clip the critic's global gradient norm to this value (0 disables clipping).
    clip_grad: float = 1.0
    # Value clipping: the new value may move at most this far from the value before the update before the
    # loss takes the worse of the clipped and unclipped errors (0 disables it).
    value_clip: float = 0.5

    def validate(self) -> None:
        for name in ("lr", "clip_grad", "value_clip"):
            if getattr(self, name) < 0:
                raise ConfigError(f"critic.{name} must be >= 0, got {getattr(self, name)}")
