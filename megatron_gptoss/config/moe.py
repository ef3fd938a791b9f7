"""Configuration of MoE on-policy fidelity: router replay."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_gptoss.errors import ConfigError

ROUTER_REPLAY = ("none", "r2", "r3")


@dataclass
class MoEReplayConfig:
    """Which experts the learner's forward uses. A token's top-k of 128 experts can flip on a tiny numeric
    difference between engine and learner, or between the policy before and during an update; replay fixes
    the experts and keeps the gates differentiable (the softmax of the router's logits at the replayed
    experts)."""

    # "none": the learner routes itself; "r3": every learner forward of a step (old, reference and update
    # passes) uses the experts the rollout engine chose for each token (the embedded engine records them);
    # "r2": the update's forwards use the experts of the learner's own old-policy pass.
    router_replay: str = "none"
    # With r3, one more forward of the old policy without replay, for the mismatch it would have had
    # (`replay/mismatch_off_*`) beside the fraction of tokens whose experts the engine chose differently.
    replay_metrics: bool = True

    def validate(self) -> None:
        if self.router_replay not in ROUTER_REPLAY:
            raise ConfigError(f"moe.router_replay={self.router_replay!r} not in {ROUTER_REPLAY}")
