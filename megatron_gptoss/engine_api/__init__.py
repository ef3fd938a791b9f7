"""The rollout-engine boundary, below both the engines and the bridge that feeds them.

protocol  SamplingParams, Generation, the `RolloutEngine` protocol, the optional `SessionEngine`
          capability (SessionTurn), expert-range slice names
buckets   (name, tensor) pairs grouped by size and packed into one byte buffer: the unit transports move
ipc       one reusable CUDA bucket buffer shared between processes by its IPC handle
"""

from megatron_gptoss.engine_api.protocol import (
    Generation,
    RolloutEngine,
    SamplingParams,
    SessionEngine,
    SessionTurn,
    expert_slice_name,
    parse_expert_slice,
)

__all__ = [
    "Generation",
    "RolloutEngine",
    "SamplingParams",
    "SessionEngine",
    "SessionTurn",
    "expert_slice_name",
    "parse_expert_slice",
]
