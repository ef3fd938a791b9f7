"""The weight bridge from the learner's shards to rollout engines: plan -> export -> transport (README.md).

plan       pure: (learner layout, engine layout, parameter metadata) -> transfers in buckets
export     WeightExporter: full HF-named tensors in size-bounded buckets on one rank, from any layout
transport  moving packed buckets to engines: in-process, CUDA IPC (a reused buffer), broadcast
"""

from megatron_gptoss.bridge.export import WeightExporter
from megatron_gptoss.bridge.plan import EngineLayout, ParamInfo, Transfer, plan_transfers

__all__ = ["EngineLayout", "ParamInfo", "Transfer", "WeightExporter", "plan_transfers"]
