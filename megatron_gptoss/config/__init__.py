"""Typed configuration: one dataclass per concern, presets as functions, YAML files hold overrides."""

from megatron_gptoss.config.agent import AgentConfig, SandboxConfig
from megatron_gptoss.config.algorithm import AlgorithmConfig
from megatron_gptoss.config.data import DataConfig
from megatron_gptoss.config.engine import EmbeddedEngineConfig
from megatron_gptoss.config.loader import build_config, config_to_dict, load_config
from megatron_gptoss.config.model import (
    MODEL_PRESETS,
    ModelConfig,
    gpt_oss_20b,
    gpt_oss_120b,
    gpt_oss_demo,
    gpt_oss_tiny,
)
from megatron_gptoss.config.reward import RewardConfig
from megatron_gptoss.config.train import (
    EnvConfig,
    OptimConfig,
    ParallelConfig,
    PPOConfig,
    RolloutConfig,
    RunConfig,
    SFTConfig,
    TrainConfig,
)
from megatron_gptoss.errors import ConfigError

__all__ = [
    "AlgorithmConfig",
    "AgentConfig",
    "SandboxConfig",
    "ConfigError",
    "DataConfig",
    "EmbeddedEngineConfig",
    "EnvConfig",
    "MODEL_PRESETS",
    "ModelConfig",
    "OptimConfig",
    "PPOConfig",
    "ParallelConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "SFTConfig",
    "TrainConfig",
    "build_config",
    "config_to_dict",
    "gpt_oss_120b",
    "gpt_oss_20b",
    "gpt_oss_demo",
    "gpt_oss_tiny",
    "load_config",
]
