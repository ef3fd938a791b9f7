"""Pipeline parallelism: the layers cut into stages, packed micro-batches, and the 1F1B and interleaved
schedules of `torch.distributed.pipelining` over the pp group.

    stages       S = pp x vpp stages of consecutive layers (`split_layers`: even, or given counts);
                 stage s lives on pp rank s % pp, so rank r holds r, r + pp, ... (Megatron's interleaving).
                 Stage 0 also holds the embedding, stage S - 1 the final norm and the output layer.
    micro-batch  one packed row of `token_budget` tokens: whole documents, positions restarting at 0 in
                 each, a filler document of padding at the end (`PackedBatch`, `parallel/packing.py`).
    stage i/o    first   input_ids [1, N]   -> hidden [1, N', H]      (point-to-point between stages)
                 middle  hidden [1, N', H]  -> hidden [1, N', H]
                 last    hidden [1, N', H]  -> (log-prob [1, N], entropy [1, N]) fp32
                 N' = N / cp (context parallel: this rank's zig-zag chunks), divided by tp under
                 sequence parallelism; the last stage gathers its log-probs and entropy over cp, so
                 they cover the micro-batch's N tokens in order. Every stage also receives its
                 micro-batch's positions [1, N] (keyword; the last stage also the targets) and its
                 document boundaries computed on the host when packing: cu_seqlens [1, D + 1] (padded
                 with N to the most documents of a micro-batch) and the longest document [1], host
                 tensors that each stage copies to its device.
    host syncs   none of the runner's in a training step: inputs are copied from pinned memory
                 without blocking, the boundaries are known on the host, and the loss gathers each row's
                 values with index tensors built on the host (no boolean mask on device tensors).
    schedules    training: Schedule1F1B (vpp = 1) or ScheduleInterleaved1F1B (vpp > 1); the last stage
                 calls the caller's loss on each micro-batch as soon as its log-probs exist.
                 Log-probs only: ScheduleGPipe / ScheduleLoopedBFS without a loss.

Who holds what: every rank of a pp group gets the same `PackedBatch`; the first stage reads its
input_ids, every stage the positions of the micro-batch it runs, the last stage the targets and the
loss inputs. Gradients accumulate into the stage parameters (`.grad`, or `main_grad` under the
`DistributedOptimizer`); losses are not scaled by the number of micro-batches (the caller's loss is
already its share of the mini-batch, see `rl.ppo_loss`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)

from megatron_gptoss.config import ModelConfig
from megatron_gptoss.errors import LayoutError
from megatron_gptoss.model.gpt_oss import GPTOSSModel
from megatron_gptoss.model.moe import Router, no_route, routing_dtype
from megatron_gptoss.model.sampled_softmax import VocabSample, sampled_token_logprobs
from megatron_gptoss.parallel.collectives import chunk_sizes
from megatron_gptoss.parallel.context_parallel import ContextParallel
from megatron_gptoss.parallel.dims import ParallelDims
from megatron_gptoss.parallel.packing import PackedBatch, cu_seqlens_from_positions, pack_micro_batches
from megatron_gptoss.utils.host import to_device

# (source rows of a micro-batch [R], log-probs [R, T], entropy [R, T]) -> this micro-batch's loss share
LossFn = Callable[[Tensor, Tensor, Tensor], Tensor]


# ------------------------------------------------------------------------------------------------
# Stages
def split_layers(num_layers: int, num_stages: int, counts: Sequence[int] | None = None) -> list[range]:
    """Consecutive layer ranges of `num_stages` stages.

    `counts` gives each stage's number of layers (the first and last stage may have 0: their embedding
    or output layer is the stage). Without it the split is even and the remainder goes to the middle
    stages first, so the stages that also hold the embedding and the output layer are the lighter ones.
    """
    if counts is None:
        base, extra = divmod(num_layers, num_stages)
        order = [*range(1, num_stages - 1), num_stages - 1, 0] if num_stages > 1 else [0]
        plus = set(order[:extra])
        counts = [base + (s in plus) for s in range(num_stages)]
    counts = list(counts)
    if len(counts) != num_stages:
        raise LayoutError(f"{len(counts)} pipeline layer counts given for {num_stages} (virtual) stages")
    if sum(counts) != num_layers:
        raise LayoutError(f"pipeline layer counts {counts} sum to {sum(counts)}, the model has {num_layers}")
    if any(c < 0 for c in counts) or any(c == 0 for c in counts[1:-1]):
        raise LayoutError(f"pipeline layer counts {counts}: a middle stage needs at least one layer")
    if num_stages == 1 and counts[0] == 0:
        raise LayoutError("a single stage needs the model's layers")
    starts = [sum(counts[:s]) for s in range(num_stages)]
    return [range(start, start + c) for start, c in zip(starts, counts)]


@dataclass(frozen=True)
class StagePlan:
    """One (virtual) pipeline stage: its index among `num_stages` and its layers."""

    index: int
    num_stages: int
    layers: range

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1


def stage_plans(dims: ParallelDims, num_layers: int, counts: Sequence[int] | None = None) -> list[StagePlan]:
    """This rank's stages in chunk order: stage pp_rank + c * pp for chunk c < vpp."""
    total = dims.pp * dims.vpp
    ranges = split_layers(num_layers, total, counts)
    indices = [dims.coord("pp") + c * dims.pp for c in range(dims.vpp)]
    return [StagePlan(i, total, ranges[i]) for i in indices]


def build_stage_model(config: ModelConfig, plan: StagePlan, dtype=torch.float32, device=None) -> GPTOSSModel:
    """The single-device model of one stage (its layers keep their global names); parameters are
    uninitialised on the meta device, else randomly initialised as the constructor does."""
    return GPTOSSModel(
        config, dtype, device, layers=plan.layers, pre_process=plan.is_first, post_process=plan.is_last
    )


@torch.no_grad()
def copy_from_full(stage: nn.Module, full: nn.Module) -> None:
    """Copy the full model's tensors into the stage's parameters of the same names (all must exist)."""
    source = dict(full.named_parameters())
    for name, param in stage.named_parameters():
        param.copy_(source[name])


# ------------------------------------------------------------------------------------------------
# Running the stages
class StageModule(nn.Module):
    """One stage model behind the stage i/o of the module docstring (the module the schedule runs)."""

    def __init__(self, model: GPTOSSModel, plan: StagePlan, cp: ContextParallel | None = None):
        super().__init__()
        self.model, self.plan = model, plan
        self.cp = cp if cp is not None else ContextParallel(1, 0)
        self.temperature, self.chunk_size = 1.0, 1024
        self.vocab_sample: VocabSample | None = None  # PipelineRunner.scoring

    def forward(
        self,
        x: Tensor,
        positions: Tensor,
        targets: Tensor | None = None,
        routing: Tensor | None = None,
        boundaries: tuple[Tensor, int] | None = None,
        cu_seqlens: Tensor | None = None,
        max_seqlen: Tensor | None = None,
    ):
        """The micro-batch's document boundaries: `boundaries` (cu_seqlens on the device, longest
        document), or host tensors `cu_seqlens` [1, D + 1] padded with N and `max_seqlen` [1] (the pp
        schedules' split of `PackedBatch.boundary_tensors`), else derived from `positions`. Under context
        parallelism the inputs are this rank's local tokens and the boundaries the micro-batch's, kept on
        the host (the attention reads them there)."""
        split = self.cp.size > 1
        if boundaries is None and cu_seqlens is not None and max_seqlen is not None:
            cu = cu_seqlens.reshape(-1)
            cu = cu[: int((cu < cu[-1]).sum()) + 1]  # host tensor: the padding repeats the last bound
            boundaries = (cu if split else to_device(cu, positions.device), int(max_seqlen.reshape(-1)[0]))
        if boundaries is None:
            if split:
                raise ValueError("a context-parallel stage needs the micro-batch's document boundaries")
            boundaries = cu_seqlens_from_positions(positions)
        cu_seqlens_dev, longest = boundaries
        if routing is not None:  # [1, N, layers, k] -> [N, layers, k]
            routing = routing.reshape(-1, *routing.shape[2:])
        hidden = self.model.hidden_states(x, positions, cu_seqlens_dev, longest, routing=routing)
        if not self.plan.is_last:
            return hidden
        if targets is None:
            raise ValueError("the last pipeline stage needs the targets")
        if self.vocab_sample is not None:  # a supervised step's sampled softmax
            weight = self.model.output_weight()
            lp, ent = sampled_token_logprobs(
                hidden, weight, targets, self.vocab_sample, self.temperature, self.chunk_size
            )
        else:
            lp, ent = self.model.token_logprobs(hidden, targets, self.temperature, self.chunk_size)
        return self.cp.gather(lp), self.cp.gather(ent)


class PipelineRunner:
    """Forward/backward and log-prob passes of packed micro-batches through this rank's stages.

    `models[c]` is the (parallelised) stage model of `plans[c]`. With pp == 1 the micro-batches run in a
    plain loop. Results (loss, log-probs) are returned on every rank of the pp group."""

    def __init__(
        self,
        models: Sequence[GPTOSSModel],
        plans: Sequence[StagePlan],
        dims: ParallelDims,
        chunk_size: int = 1024,
    ):
        if len(models) != len(plans) or len(plans) != dims.vpp:
            raise ValueError(f"{len(models)} models and {len(plans)} plans for {dims.vpp} virtual stages")
        self.dims = dims
        self.cp = ContextParallel.of(dims)
        self.modules = [StageModule(m, p, self.cp) for m, p in zip(models, plans)]
        for module in self.modules:
            module.chunk_size = chunk_size
        self.has_last = any(p.is_last for p in plans)
        self.config = models[0].config
        param = next(models[0].parameters())
        self.device, self.dtype = param.device, param.dtype
        self._schedules: dict[tuple[int, int, bool], object] = {}
        self._loss: tuple[PackedBatch, LossFn] | None = None

    # packing ------------------------------------------------------------------------------------
    def pack(
        self,
        input_ids: Tensor,
        targets: Tensor,
        valid: Tensor,
        token_budget: int,
        routing: Tensor | None = None,
    ) -> PackedBatch:
        """`pack_micro_batches` with the same number of micro-batches on every data-parallel rank (expert
        parallelism exchanges tokens across them), at least pp of them (the 1F1B schedules need a
        micro-batch per stage; the extra ones are filler) and, for the interleaved schedule, a multiple
        of pp."""
        if token_budget % self.token_multiple():
            raise LayoutError(
                f"token budget {token_budget} must be a multiple of {self.token_multiple()} (2 x "
                f"context_parallel_size={self.dims.cp}, times tp={self.dims.tp} under sequence parallel)"
            )
        local = pack_micro_batches(input_ids, targets, valid, token_budget).num_micro_batches
        count = torch.tensor([local], dtype=torch.long, device=self.comm_device())
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.dims.group("dp"))
        multiple = self.dims.pp if self.dims.vpp > 1 else 1
        least = max(int(count), self.dims.pp)
        return pack_micro_batches(input_ids, targets, valid, token_budget, least, multiple, routing)

    def token_multiple(self) -> int:
        """What every micro-batch's token count must be a multiple of: 2cp zig-zag chunks (cp > 1), each
        rank's tokens split over tp under sequence parallelism."""
        cp = 2 * self.dims.cp if self.dims.cp > 1 else 1
        return cp * (self.dims.tp if self.dims.sequence_parallel else 1)

    # passes -------------------------------------------------------------------------------------
    def forward_backward(self, packed: PackedBatch, loss_fn: LossFn, temperature: float = 1.0) -> Tensor:
        """Forward and backward of every micro-batch; `loss_fn(rows, logprobs, entropy)` gives each one's
        loss. Gradients accumulate in the stage parameters. Returns the summed loss (fp32 scalar,
        detached) on every rank of the pp group."""
        self._set_temperature(temperature)
        if self.dims.pp == 1:
            total = torch.zeros((), dtype=torch.float32, device=self.device)
            for m in range(packed.num_micro_batches):
                lp, ent = self._run_single(packed, m)
                loss = self._micro_loss(packed, loss_fn, m, lp, ent)
                loss.backward()
                total += loss.detach().float()
            return total
        schedule = self._schedule(packed, train=True)
        losses: list[Tensor] = []
        self._loss = (packed, loss_fn)
        try:
            args, kwargs = self._inputs(packed)
            target = torch.arange(packed.num_micro_batches)[:, None] if self.has_last else None
            schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)  # type: ignore[attr-defined]
        finally:
            self._loss = None
        total = torch.zeros((), dtype=torch.float32, device=self.comm_device())
        if losses:
            total += torch.stack([x.detach().float() for x in losses]).sum().to(total.device)
        return self._from_last(total)

    @torch.no_grad()
    def logprobs(self, packed: PackedBatch, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
        """Per-token (log-prob, entropy) [B, T] fp32 of `packed.targets` (0 at padding), on every rank of
        the pp group. No loss, no graph."""
        self._set_temperature(temperature)
        if self.dims.pp == 1:
            outs = [self._run_single(packed, m) for m in range(packed.num_micro_batches)]
            lp, ent = torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])
        else:
            schedule = self._schedule(packed, train=False)
            args, kwargs = self._inputs(packed)
            out = schedule.step(*args, **kwargs)  # type: ignore[attr-defined]
            shape = (packed.num_micro_batches, packed.token_budget)
            lp = out[0] if out is not None else torch.zeros(shape, device=self.comm_device())
            ent = out[1] if out is not None else torch.zeros(shape, device=self.comm_device())
            both = self._from_last(torch.stack([lp.float(), ent.float()]).to(self.comm_device()))
            lp, ent = both[0], both[1]
        return packed.unpack(lp), packed.unpack(ent)

    @torch.no_grad()
    def routed_logprobs(self, packed: PackedBatch, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
        """`logprobs` and the experts every token was routed to (the replayed ones where `packed` carries a
        routing): [B, T, num_layers, k] in `routing_dtype`, `no_route` at padding, on every rank of the tp
        and pp groups."""
        routers = self.routers()
        captured: dict[int, list[Tensor]] = {layer: [] for layer in routers}
        for layer, router in routers.items():
            router.capture = captured[layer]
        try:
            lp, _ = self.logprobs(packed, temperature)
        finally:
            for router in routers.values():
                router.capture = None
        return lp, self._assemble_routing(packed, captured)

    def routers(self) -> dict[int, Router]:
        """This rank's routers by global layer index."""
        return {
            int(index): layer.mlp.router  # type: ignore[union-attr,misc]
            for module in self.modules
            for index, layer in module.model.decoder.layers.items()
        }

    def _assemble_routing(self, packed: PackedBatch, captured: dict[int, list[Tensor]]) -> Tensor:
        """The micro-batches' captured experts of this rank's layers (chunks of the tokens under tp and cp)
        -> [B, T, layers, k] of every layer (gathered over tp, cp and pp), no-route -1 while int32."""
        m, n_full = packed.input_ids.shape
        n = n_full // self.dims.cp
        k, layers = self.config.moe_router_topk, self.config.num_layers
        device = self.comm_device()
        full = torch.full((m, n_full, layers, k), -1, dtype=torch.int32, device=device)
        for layer in sorted(captured):
            chunks = captured[layer]
            if len(chunks) != m:
                raise RuntimeError(f"layer {layer} routed {len(chunks)} micro-batches of {m}")
            x = torch.stack([c.to(device=device, dtype=torch.int32) for c in chunks])  # [M, n_r, k]
            if x.shape[1] != n:  # this tp rank's chunk of every micro-batch's tokens
                sizes = chunk_sizes(n, self.dims.tp)
                padded = torch.full((m, max(sizes), k), -1, dtype=torch.int32, device=device)
                padded[:, : x.shape[1]] = x
                parts = [torch.empty_like(padded) for _ in sizes]
                dist.all_gather(parts, padded, group=self.dims.group("tp"))
                x = torch.cat([part[:, :size] for part, size in zip(parts, sizes)], dim=1)
            full[:, :, layer] = self.cp.gather(x) if self.cp.size > 1 else x
        if self.dims.pp > 1:  # each stage holds its own layers: -1 elsewhere
            dist.all_reduce(full, op=dist.ReduceOp.MAX, group=self.dims.group("pp"))
        dtype = routing_dtype(self.config.num_experts)
        out = torch.full((*packed.shape, layers, k), -1, dtype=torch.int32)
        keep = packed.row_of >= 0
        out[packed.row_of[keep], packed.col_of[keep]] = full.cpu()[keep]
        return out.masked_fill(out < 0, no_route(dtype)).to(dtype)

    # internals ----------------------------------------------------------------------------------
    def comm_device(self) -> torch.device:
        """Where this rank's small collectives live (the parameters' device; the CPU for meta)."""
        return self.device if self.device.type != "meta" else torch.device("cpu")

    @contextmanager
    def scoring(self, sample: VocabSample | None) -> Iterator[None]:
        """Within it the last stage's log-probs are those of the sampled softmax over `sample`'s rows
        (`model.sampled_softmax`; supervised steps only); None: the full vocabulary, as outside it."""
        for module in self.modules:
            module.vocab_sample = sample
        try:
            yield
        finally:
            for module in self.modules:
                module.vocab_sample = None

    def _set_temperature(self, temperature: float) -> None:
        for module in self.modules:
            module.temperature = temperature

    def _run_single(self, packed: PackedBatch, m: int) -> tuple[Tensor, Tensor]:
        module = self.modules[0]
        ids, pos, tgt = (
            to_device(self.cp.split(t[m : m + 1]), self.device)
            for t in (packed.input_ids, packed.positions, packed.targets)
        )
        routing = None
        if packed.routing is not None:
            routing = to_device(self.cp.split(packed.routing[m : m + 1]), self.device)
        cu_seqlens, longest = packed.micro_boundaries(m)
        boundaries = (cu_seqlens if self.cp.size > 1 else to_device(cu_seqlens, self.device), longest)
        return module(ids, positions=pos, targets=tgt, routing=routing, boundaries=boundaries)

    @staticmethod
    def _micro_loss(packed: PackedBatch, loss_fn: LossFn, m: int, lp: Tensor, ent: Tensor) -> Tensor:
        return loss_fn(packed.rows[m], packed.micro_rows(m, lp), packed.micro_rows(m, ent))

    def _schedule_loss(self, output: tuple[Tensor, Tensor], target: Tensor) -> Tensor:
        if self._loss is None:
            raise RuntimeError("the pipeline loss was called outside forward_backward")
        packed, loss_fn = self._loss
        lp, ent = output
        return self._micro_loss(packed, loss_fn, int(target.reshape(-1)[0]), lp, ent)

    def _inputs(self, packed: PackedBatch) -> tuple[tuple, dict]:
        first = any(module.plan.is_first for module in self.modules)
        split = self.cp.split
        args = (to_device(split(packed.input_ids), self.device),) if first else ()
        kwargs = {"positions": to_device(split(packed.positions), self.device)}
        if self.has_last:
            kwargs["targets"] = to_device(split(packed.targets), self.device)
        if packed.routing is not None:
            kwargs["routing"] = to_device(split(packed.routing), self.device)
        kwargs["cu_seqlens"], kwargs["max_seqlen"] = packed.boundary_tensors()  # host tensors
        return args, kwargs

    def _from_last(self, value: Tensor) -> Tensor:
        """`value` of the pp rank holding the last stage, on every rank of the pp group."""
        if self.dims.pp > 1:
            dist.broadcast(value, src=self.dims.members["pp"][-1], group=self.dims.group("pp"))
        return value

    def _schedule(self, packed: PackedBatch, train: bool):
        key = (packed.num_micro_batches, packed.token_budget, train)
        if key not in self._schedules:
            stages: list = [self._stage(module, packed.token_budget, train) for module in self.modules]
            n = packed.num_micro_batches
            if train:
                self._schedules[key] = (
                    Schedule1F1B(stages[0], n, loss_fn=self._schedule_loss, scale_grads=False)
                    if len(stages) == 1
                    else ScheduleInterleaved1F1B(stages, n, loss_fn=self._schedule_loss, scale_grads=False)
                )
            else:
                self._schedules[key] = (
                    ScheduleGPipe(stages[0], n) if len(stages) == 1 else ScheduleLoopedBFS(stages, n)
                )
        return self._schedules[key]

    def _stage(self, module: StageModule, tokens: int, train: bool) -> PipelineStage:
        """A PipelineStage with static shapes (stage i/o of the module docstring)."""
        meta = torch.device("meta")
        mine = tokens // self.dims.cp
        local = mine // self.dims.tp if self.dims.sequence_parallel else mine
        ids = torch.empty(1, mine, dtype=torch.long, device=meta)
        hidden = torch.empty(1, local, self.config.hidden_size, dtype=self.dtype, device=meta)
        hidden.requires_grad_(train)
        scores = torch.empty(1, tokens, dtype=torch.float32, device=meta)
        inputs = ids if module.plan.is_first else hidden
        outputs = (scores, scores) if module.plan.is_last else hidden
        return PipelineStage(
            module,
            module.plan.index,
            module.plan.num_stages,
            self.comm_device(),
            input_args=inputs,
            output_args=outputs,
            group=self.dims.group("pp"),
        )
