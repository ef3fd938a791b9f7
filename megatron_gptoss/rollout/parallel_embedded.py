"""The embedded engine, tensor- and expert-parallel: our model built with the learner's parallel layers over
the engine's own layout (`ParallelDims` with tp_e, ep_e, pp 1, independent of the learner's), so it serves
a model that does not fit one GPU.

    every rank:  GPTOSSModel on the meta device -> parallelize(tp_e, ep_e) -> materialize: its shards only
    generate:    the ranks of a tp group take the same prompts and run in lockstep
                 prefill / decode: attention on this rank's heads, KV cache of its num_query_groups/tp_e KV
                 heads; MoE tokens split over tp, dispatched over ep (all-to-all)
                 last position: vocab-parallel logits [B, P/tp] -> all-gather over tp -> [B, vocab] fp32
                 -> the same seeded sampler on every tp rank: every rank of the group samples the same token
    replicas:    ranks linked by a tp or an ep group step together (the expert all-to-all needs every member
                 in every forward): blocks of lcm(tp_e, ep_e) consecutive ranks. A block holds lcm / tp_e tp
                 groups, each with prompts of its own (data parallel inside the expert-parallel group); the
                 block steps until every row of all its tp groups has stopped (a rank with nothing left
                 joins each step with one padding token). Each call checks (one small all-reduce per
                 group) that a tp group was given one request and a block one max_new_tokens, and raises
                 on every member alike otherwise
    update:      (HF name, tensor) pairs: full HF tensors (each rank narrows them to its shard with
                 `parallel.loading.shard_of_hf`, the checkpoint loader's slicing) and expert-range slices
                 (`engine_api.protocol.expert_slice_name`; a rank keeps the experts of the slice it holds);
                 MXFP4 experts (`expert_format: mxfp4`) arrive as `<name>_blocks` / `<name>_scales`, whole or
                 sliced, in HF's row order, and are copied byte for byte (fc1's rows de-interleaved)

Log-probs follow the project's convention (docs/architecture.md) exactly as `EmbeddedEngine`:
log_softmax(logits / T)[token] of the untruncated tempered distribution, fp32. Rank layout (pp 1):
rank = tp_rank + tp * dp_rank; ep part of a rank = rank % ep (`parallel.dims`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist

from megatron_gptoss.config import ConfigError, EmbeddedEngineConfig, ModelConfig, ParallelConfig
from megatron_gptoss.engine_api.protocol import SamplingParams, parse_expert_slice
from megatron_gptoss.errors import CheckpointError
from megatron_gptoss.hf.names import fc1_rows_from_hf, from_hf, hf_shapes, match_hf, match_ours
from megatron_gptoss.model import GPTOSSModel
from megatron_gptoss.model.logprobs import fp32_logits
from megatron_gptoss.model.lora import is_adapter_param
from megatron_gptoss.model.mxfp4_weight import MXFP4Weight, mxfp4_weights
from megatron_gptoss.ops import batch_invariant
from megatron_gptoss.parallel.apply import parallelize
from megatron_gptoss.parallel.dims import ParallelDims
from megatron_gptoss.parallel.loading import materialize, shard_of_hf
from megatron_gptoss.parallel.vocab_parallel import gather_logits
from megatron_gptoss.rollout.decode_graphs import Head
from megatron_gptoss.rollout.embedded import EmbeddedEngine


def lockstep_blocks(world: int, tp: int, ep: int) -> list[list[int]]:
    """The ranks that must step together (linked by tp or ep groups): blocks of lcm(tp, ep) ranks."""
    size = math.lcm(tp, ep)
    return [list(range(start, start + size)) for start in range(0, world, size)]


class ParallelEmbeddedEngine(EmbeddedEngine):
    """This rank's part of a tensor- and expert-parallel embedded engine. `dims`: the engine's own layout
    (pipeline parallel 1), built over the processes that host it; every call is collective over the rank's
    lockstep block (`generate`, `sequence_logprobs`) or local (`update_weights`, sleep / wake)."""

    accepts_expert_slices = True

    def __init__(
        self,
        config: ModelConfig,
        dims: ParallelDims,
        dtype: torch.dtype = torch.float32,
        device="cpu",
        seed=0,
        options: EmbeddedEngineConfig | None = None,
        shared: Mapping[str, torch.Tensor] | None = None,
    ):
        """`shared`: parameters (and MXFP4 expert buffers, `model.mxfp4_weight.frozen_base`) this engine uses
        as they are instead of its own (a LoRA run's frozen base, the learner's shards of the same layout;
        never written, moved or freed here); the engine then holds only the rest (the adapters), filled by
        `update_adapters`."""
        if dims.pp != 1 or dims.vpp != 1:
            raise ConfigError(f"the embedded engine runs without pipeline stages, got pp={dims.pp}")
        if dims.sequence_parallel:
            raise ConfigError("the embedded engine decodes one token per row: sequence_parallel must be off")
        self.config, self.dims = config, dims
        self.dtype, self.device = dtype, torch.device(device)
        parallel = ParallelConfig(
            tensor_model_parallel_size=dims.tp,
            expert_model_parallel_size=dims.ep,
        )
        model = GPTOSSModel(config, dtype=dtype, device="meta")
        parallelize(model, dims, parallel)  # modules swapped in place (no compile: the same object)
        shared = dict(shared or {})
        own = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        for name, tensor in shared.items():
            mine = own.get(name)
            if mine is None or mine.shape != tensor.shape or tensor.dtype != mine.dtype:
                raise ConfigError(
                    f"the shared parameter {name} ({tuple(tensor.shape)}, {tensor.dtype}) does not fit this "
                    "engine's layout "
                    f"({'absent' if mine is None else (tuple(mine.shape), mine.dtype)})"
                )
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, tensor)
        materialize(model, self.device)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name not in shared:
                    p.zero_()  # padded vocabulary rows stay zero; the rest arrives by update_weights
        self.model = model.eval()
        if options is not None and options.record_routing and dims.tp > 1:
            raise ConfigError(
                "embedded.record_routing needs tensor parallel 1 (a tp rank routes a token chunk)"
            )
        self._setup(seed, options)
        self.memory.shared = set(shared)
        self.tp_group = dims.group("tp") if dims.tp > 1 else None
        self.block_group = None
        for block in lockstep_blocks(dims.layout.world, dims.tp, dims.ep):  # collective: every rank, in order
            group = dist.new_group(block) if len(block) > dims.tp else None
            if dims.rank in block:
                self.block_group = group

    # ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def update_weights(self, tensors: Iterable[tuple[str, torch.Tensor]], strict: bool = True) -> None:
        """Copy the parameters' shards out of (HF name or expert-slice name, tensor) pairs. Full HF tensors
        are narrowed to this rank's shard; a slice's experts outside this rank's are skipped. With `strict`,
        every element of every parameter of this rank must arrive."""
        if self.asleep:
            raise RuntimeError("update_weights called while the engine sleeps; call wake_up() first")
        params = dict(self.model.named_parameters())
        packed = mxfp4_weights(self.model)
        pending: dict[str, dict[str, torch.Tensor]] = {}
        written: set[str] = set()
        experts: dict[str, torch.Tensor] = {}  # our expert parameter -> which local experts arrived
        for name, tensor in tensors:
            sliced = parse_expert_slice(name)
            base = sliced[0] if sliced else name
            if base.endswith(("_blocks", "_scales")) and packed:
                target, part = self._packed_target(base, packed)
                start, stop = sliced[1:] if sliced else (0, self.config.num_experts)
                got = experts.setdefault(
                    f"{target}.{part}", torch.zeros(packed[target].shape[0], dtype=torch.bool)
                )
                self._load_packed(packed[target], target, part, tensor, start, stop, got)
                continue
            match = match_hf(base)
            if match is None or match.ours not in params:
                raise CheckpointError(f"unexpected tensor {name!r}: not a parameter of this model")
            if match.ours in self.memory.shared:
                raise CheckpointError(f"{name!r} is the learner's shared base: the engine never writes it")
            param = params[match.ours]
            if sliced is not None:
                got = experts.setdefault(match.ours, torch.zeros(param.shape[0], dtype=torch.bool))
                self._load_slice(param, match, tensor, sliced[1], sliced[2], got)
                continue
            parts = pending.setdefault(match.ours, {})
            parts[name] = tensor
            if len(parts) == len(match.hf):
                param.copy_(shard_of_hf(pending.pop(match.ours), param, match.ours, self.config, self.dims))
                written.add(match.ours)
        if pending:
            absent = [n for ours, parts in pending.items() for n in match_ours(ours).hf if n not in parts]
            raise CheckpointError(f"missing tensors {sorted(absent)}")
        written |= {ours for ours, got in experts.items() if bool(got.all())}
        expected = set(params) | {f"{n}.{part}" for n in packed for part in ("blocks", "scales")}
        expected -= set(self.memory.shared)
        if strict and expected - written:
            absent = sorted(expected - written)
            raise CheckpointError(f"missing tensors (or experts) of {absent}")
        self.memory.weights_loaded()
        self.weight_version += 1

    @torch.no_grad()
    def update_adapters(self, tensors: Mapping[str, torch.Tensor]) -> int:
        """Copy this rank's shards of every LoRA adapter (our names, the learner's layout, which is this
        engine's) into the engine's own adapters; returns the bytes copied."""
        if self.asleep:
            raise RuntimeError("update_adapters called while the engine sleeps; call wake_up() first")
        params = {n: p for n, p in self.model.named_parameters() if is_adapter_param(n)}
        if set(tensors) != set(params):
            raise CheckpointError(f"adapters differ from the engine's: {sorted(set(tensors) ^ set(params))}")
        copied = 0
        for name, tensor in tensors.items():
            params[name].copy_(tensor)
            copied += tensor.numel() * tensor.element_size()
        self.memory.weights_loaded()
        self.weight_version += 1
        return copied

    def _load_slice(
        self, param, match, tensor: torch.Tensor, start: int, stop: int, got: torch.Tensor
    ) -> None:
        """Experts [start, stop) in HF layout -> the ones this rank holds, converted, into `param`."""
        full = hf_shapes(match, self.config)[0]
        if stop > full[0] or tuple(tensor.shape) != (stop - start, *full[1:]):
            raise CheckpointError(
                f"expert slice [{start}:{stop}] of {match.hf[0]!r} has shape {tuple(tensor.shape)}, "
                f"expected {(stop - start, *full[1:])} of {full[0]} experts"
            )
        first = self.dims.coord("ep") * param.shape[0]  # experts split evenly over ep, in ep-rank order
        lo, hi = max(start, first), min(stop, first + param.shape[0])
        if lo < hi:
            param[lo - first : hi - first].copy_(
                from_hf(match, [tensor[lo - start : hi - start]], self.config)
            )
            got[lo - first : hi - first] = True

    def _packed_target(self, name: str, packed: Mapping[str, MXFP4Weight]) -> tuple[str, str]:
        """(our MXFP4 weight, "blocks" or "scales") that the HF name `<weight>_blocks` / `_scales` fills."""
        base, part = name.rsplit("_", 1)
        match = match_hf(base)
        if match is None or match.ours not in packed:
            raise CheckpointError(f"unexpected tensor {name!r}: not an MXFP4 expert weight of this model")
        if f"{match.ours}.{part}" in self.memory.shared:
            raise CheckpointError(f"{name!r} is the learner's shared base: the engine never writes it")
        return match.ours, part

    def _load_packed(
        self, weight: MXFP4Weight, ours: str, part: str, tensor: torch.Tensor, start: int, stop: int, got
    ) -> None:
        """Experts [start, stop) of an MXFP4 weight's blocks or scales (HF row order, uint8) -> the ones this
        rank holds, into its buffer (fc1's rows de-interleaved to our [gate; up]; `MXFP4Weight.copy_experts_`
        re-encodes them into the weight's byte format)."""
        buffer = getattr(weight, part)
        full = (self.config.num_experts, *buffer.shape[1:])
        if tensor.dtype != torch.uint8 or stop > full[0] or tuple(tensor.shape) != (stop - start, *full[1:]):
            raise CheckpointError(
                f"MXFP4 {part} of {ours} for experts [{start}:{stop}]: got {tensor.dtype} "
                f"{tuple(tensor.shape)}, expected torch.uint8 {(stop - start, *full[1:])}"
            )
        first = self.dims.coord("ep") * buffer.shape[0]  # experts split evenly over ep, in ep-rank order
        lo, hi = max(start, first), min(stop, first + buffer.shape[0])
        if lo < hi:
            rows = tensor[lo - start : hi - start]
            rows = fc1_rows_from_hf(rows) if ".linear_fc1." in ours else rows
            weight.copy_experts_(lo - first, *((rows, None) if part == "blocks" else (None, rows)))
            got[lo - first : hi - first] = True

    # ----------------------------------------------------------------------------------------------
    def _check_request(self, prompts: list[list[int]], params: SamplingParams | None) -> None:
        """The ranks of a tp group must pass the same prompts and sampling parameters, and a lockstep block
        the same number of decode steps (else collectives would pair up wrongly or wait forever): one small
        all-reduce per group compares a fingerprint; every member raises alike on a mismatch."""
        checksum = sum((i + 1) * t for p in prompts for i, t in enumerate(p)) % (1 << 31)
        steps = -1 if params is None else params.max_new_tokens
        sampling = [] if params is None else [
            round(params.temperature * 1e6), round(params.top_p * 1e6), params.top_k,
            -1 if params.seed is None else params.seed,
        ]  # fmt: skip
        request = [len(prompts), sum(len(p) for p in prompts), checksum, *sampling, steps]
        for group, values, what in (
            (self.tp_group, request, "prompts and sampling parameters across its tensor-parallel group"),
            (self.block_group, [steps], "max_new_tokens across its lockstep block"),
        ):
            if group is None:
                continue
            both = torch.tensor([*values, *(-v for v in values)], dtype=torch.int64, device=self.device)
            dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
            if not torch.equal(both[: len(values)], -both[len(values) :]):
                raise ValueError(f"every rank of the engine must pass the same {what}")

    def _steps_alone(self) -> bool:
        """Whether this rank's steps call no collective (no tp group, no lockstep block: tp 1, ep 1)."""
        return self.tp_group is None and self.block_group is None

    def _graph_mode(self) -> str | None:
        """A rank that steps alone captures graphs as the single-device engine does; a sharded step only
        runs the padded check (its collectives are not captured)."""
        if self._steps_alone():
            return super()._graph_mode()
        return "padded" if self.options.cuda_graphs == "padded" else None

    def _graph_head(self) -> Head | None:
        """The single-device head for a rank that steps alone; else None: a sharded step's logits are
        gathered over the tp group, outside the bucketed step."""
        return super()._graph_head() if self._steps_alone() else None

    def _kv_heads(self) -> int:
        return self.config.num_query_groups // self.dims.tp

    def _logits(self, last: torch.Tensor) -> torch.Tensor:
        """[B, H] -> [B, vocab_size] fp32 on every rank of the tp group: local rows, then all-gathered (in
        the batch-invariant mode the local rows are `model.logprobs.fp32_logits`', as the learner's
        vocab-parallel head computes them)."""
        if self.tp_group is None:
            return super()._logits(last)
        head = self.model.output_layer
        assert head is not None
        if batch_invariant.active():
            local = fp32_logits(last, head.weight)
        else:
            local = last.float() @ head.weight.float().t()
        return gather_logits(local, self.tp_group, self.config.vocab_size)

    def _block_any(self, flag: bool) -> bool:
        """Whether `flag` holds on any rank of the lockstep block (one all-reduce where the block is wider
        than the tp group; tp ranks schedule the same rows and sample the same tokens, so agree already). A
        rank whose rows have all stopped joins the block's remaining steps with a padding token."""
        if self.block_group is None:
            return flag
        running = torch.tensor([int(flag)], device=self.device)
        dist.all_reduce(running, op=dist.ReduceOp.MAX, group=self.block_group)
        return int(running) > 0
