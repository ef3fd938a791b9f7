"""What a LoRA run's checkpoint (adapters only) must agree on with the run loading it: the adapters' rank
and targets, and the base they were trained on (`base_reference`: the `run.init_from_hf` directory, or the
random initialisation's seed)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megatron_gptoss.config import ModelConfig
from megatron_gptoss.errors import CheckpointError


def base_reference(config: ModelConfig, run_config: Mapping[str, Any]) -> dict[str, Any] | None:
    """Where the frozen base of a LoRA run comes from (None without LoRA): {"init_from_hf": path}, or
    {"seed": s} for the random initialisation (from the run config's `run` section; none gives {})."""
    if not config.lora.enabled:
        return None
    run = run_config.get("run") or {}
    if run.get("init_from_hf"):
        return {"init_from_hf": str(run["init_from_hf"])}
    return {"seed": run["seed"]} if "seed" in run else {}


def check_adapters(
    manifest: Mapping[str, Any], config: ModelConfig, base: dict[str, Any] | None, path: Path
) -> None:
    """CheckpointError when the adapters-only checkpoint's rank, targets or base differ from the run's."""
    if not manifest["contents"].get("adapters_only"):
        return
    stored, lora = manifest["model"].get("lora") or {}, config.lora
    rank, targets = stored.get("rank"), stored.get("targets")
    if (rank, targets) != (lora.rank, lora.targets):
        raise CheckpointError(
            f"{path} holds LoRA adapters of rank {rank} on {targets}, "
            f"this run has model.lora.rank={lora.rank} on {lora.targets}"
        )
    if manifest.get("base") != base:
        raise CheckpointError(
            f"{path} holds LoRA adapters trained on the base {manifest.get('base')}, "
            f"this run's base is {base}"
        )
