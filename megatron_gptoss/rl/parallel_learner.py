"""The learner's side of a PPO step on the parallel policy (pipeline stages, tensor / sequence / expert
parallel, data parallel with the distributed optimizer): the same step as `rl.learner`, rows split over
the data-parallel replicas.

    every rank holds the whole rollout batch (token ids and rewards are small)
    prepare:  advantages on the whole batch (GRPO groups stay whole); replica d computes the old and
              reference log-probs of its rows (contiguous blocks, `torch.tensor_split`), packed into
              micro-batches; a sum over the dp group gives every rank the whole [B, T] (adding zeros is
              exact), and the rollout correction runs on the whole batch, identically everywhere
    update:   `learner.run_epochs`; per mini-batch, replica d packs its block of the mini-batch's rows,
              the loss of each micro-batch is normalised by the mini-batch's denominators over all
              replicas (`loss_denominators` with the dp group), gradients are summed over dp by the
              distributed optimizer, one optimizer step

Context parallel ranks hold the same rows: each runs its chunks of every micro-batch's tokens, and the
runner gathers the log-probs and entropy over cp, so the loss, its denominators, the metrics, the
rollout correction, the critic's values and router replay's tables are computed alike on every cp rank
(replicated; the gradients of each rank's tokens are summed over dp x cp by the optimizer).

Metrics are the single-process ones: each micro-batch's metrics (on the last pipeline stage) are combined
as `learner.MetricTotals` does, over micro-batches and replicas, then sent to every rank of the pp group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_gptoss.config import PPOConfig
from megatron_gptoss.config.algorithm import AlgorithmConfig
from megatron_gptoss.config.moe import MoEReplayConfig
from megatron_gptoss.model.lora import adapters_disabled
from megatron_gptoss.model.moe import no_route
from megatron_gptoss.model.sampled_softmax import VocabSample
from megatron_gptoss.parallel.context_parallel import bucket_tokens
from megatron_gptoss.parallel.data_parallel import DistributedOptimizer
from megatron_gptoss.parallel.dims import ParallelDims
from megatron_gptoss.parallel.pipeline import PackedBatch, PipelineRunner
from megatron_gptoss.rl.batch import RolloutBatch
from megatron_gptoss.rl.learner import MetricTotals, micro_loss, prepare_with, run_epochs
from megatron_gptoss.rl.ppo_loss import loss_denominators
from megatron_gptoss.utils.host import to_device


class ParallelPolicy:
    """The policy's stage models on this rank (`runner`), their optimizer (None for a frozen reference
    policy) and the layout. `token_budget`: tokens per packed micro-batch (0: the longest row, or the
    replica's tokens over `ppo.num_micro_batches` when larger; the maximum over the replicas; under
    context parallelism rounded up by `bucket_tokens`)."""

    def __init__(
        self,
        runner: PipelineRunner,
        dims: ParallelDims,
        optimizer: DistributedOptimizer | None = None,
        token_budget: int = 0,
        replays: bool = True,
        base_only: bool = False,
        micro_batches: int = 1,
    ):
        """`replays`: whether this model's forwards use a batch's `routing` (router replay); a critic's
        routers are its own. `base_only`: log-probs of the models with their LoRA adapters disabled (the
        reference policy of a LoRA run: the frozen base, sharing the policy's models). `micro_batches`: the
        log-prob passes pack a replica's rows into this many micro-batches (as the update does), so their
        activations stay those of one micro-batch."""
        self.runner, self.dims, self.optimizer, self.token_budget = runner, dims, optimizer, token_budget
        self.replays, self.base_only, self.micro_batches = replays, base_only, micro_batches

    # ----------------------------------------------------------------------------------------------
    def my_rows(self, rows: int) -> torch.Tensor:
        """This replica's contiguous block of `rows` rows (possibly empty)."""
        return torch.tensor_split(torch.arange(rows), self.dims.dp)[self.dims.coord("dp")]

    def pack(self, batch: RolloutBatch, micro_batches: int = 1) -> PackedBatch:
        budget = self.token_budget
        if not budget:
            lengths = batch.valid.sum(1)
            longest = int(lengths.max()) if len(batch) else 1
            budget = max(longest, -(-int(lengths.sum()) // micro_batches))
            top = torch.tensor([budget], dtype=torch.long, device=self.runner.comm_device())
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=self.dims.group("dp"))
            budget = int(top)
            if self.dims.cp > 1:  # a bounded set of chunk lengths: `bucket_tokens`
                budget = bucket_tokens(budget)
        multiple = self.runner.token_multiple()  # cp's 2cp chunks, sequence parallel's tp
        budget = -(-budget // multiple) * multiple
        # only loss tokens need log-probs: the others are marked -1 (GPTOSSModel.token_logprobs)
        targets = batch.targets.masked_fill(batch.loss_mask == 0, -1)
        routing = batch.routing if self.replays else None
        return self.runner.pack(batch.input_ids, targets, batch.valid, budget, routing)

    @torch.no_grad()
    def logprobs(self, batch: RolloutBatch, temperature: float) -> torch.Tensor:
        """Per-token log-probs [B, T] fp32 of the whole batch on every rank (each replica computes its
        block of rows)."""
        rows = self.my_rows(len(batch))
        mine = batch.select(rows)
        models = [m.model for m in self.runner.modules] if self.base_only else []
        with adapters_disabled(*models):
            lp, _ = self.runner.logprobs(self.pack(mine, self.micro_batches), temperature)
        full = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=lp.device)
        full[rows.to(lp.device)] = lp.float()
        if self.dims.dp > 1:
            dist.all_reduce(full, op=dist.ReduceOp.SUM, group=self.dims.group("dp"))
        return full.cpu()

    @torch.no_grad()
    def routed_logprobs(self, batch: RolloutBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """`logprobs` and the experts of every input token at every layer [B, T, layers, k] (the replayed
        ones where `batch.routing` has them), on every rank."""
        rows = self.my_rows(len(batch))
        lp, routing = self.runner.routed_logprobs(
            self.pack(batch.select(rows), self.micro_batches), temperature
        )
        full = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=lp.device)
        full[rows.to(lp.device)] = lp.float()
        table = torch.full((*batch.input_ids.shape, *routing.shape[2:]), -1, dtype=torch.int32)
        table[rows] = routing.to(torch.int32).masked_fill(routing == no_route(routing.dtype), -1)
        if self.dims.dp > 1:
            dist.all_reduce(full, op=dist.ReduceOp.SUM, group=self.dims.group("dp"))
            device = self.runner.comm_device()
            table = table.to(device)
            dist.all_reduce(table, op=dist.ReduceOp.MAX, group=self.dims.group("dp"))
            table = table.cpu()
        return full.cpu(), table.masked_fill(table < 0, no_route(routing.dtype)).to(routing.dtype)

    @torch.no_grad()
    def replay_flips(self, batch: RolloutBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The old policy's log-probs [B, T] with `batch.routing` replayed, and per layer [layers, 2] the
        replayed tokens whose experts differ from the ones the learner's routers pick, and the replayed
        tokens, summed over the world (collective)."""
        routers = self.runner.routers()
        device = self.runner.comm_device()
        for router in routers.values():
            router.flips = torch.zeros(2, dtype=torch.int64, device=device)
        try:
            lp = self.logprobs(batch, temperature)
            counts = torch.zeros(self.runner.config.num_layers, 2, dtype=torch.int64, device=device)
            for layer, router in routers.items():
                assert router.flips is not None
                counts[layer] = router.flips
        finally:
            for router in routers.values():
                router.flips = None
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
        return lp, counts.cpu()

    # ----------------------------------------------------------------------------------------------
    def accumulate_gradients(
        self, mini_batch: RolloutBatch, cfg: PPOConfig, temperature: float, on_policy: bool
    ) -> dict[str, float]:
        """Forward and backward of this replica's rows of `mini_batch`; the mini-batch's metrics."""
        mine = mini_batch.select(self.my_rows(len(mini_batch)))
        denom = loss_denominators([mine.loss_mask.to(self.runner.comm_device())], self.dims.group("dp"))
        packed = self.pack(mine, cfg.num_micro_batches)
        totals = MetricTotals()

        def loss_fn(rows: torch.Tensor, logprobs: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
            if not len(rows):  # a filler micro-batch: a zero tied to the graph, no metrics
                return logprobs.sum() * 0.0
            loss, metrics = micro_loss(mine.select(rows), logprobs, entropy, cfg, denom, on_policy)
            totals.add(metrics)
            return loss

        self.runner.forward_backward(packed, loss_fn, temperature)
        return self._combine(totals)

    def _combine(self, totals: MetricTotals) -> dict[str, float]:
        """Micro-batch metrics of every replica combined (last stage), then sent over the pp group."""
        result: dict[str, float] | None = None
        if self.runner.has_last:
            keys = sorted(totals.sums)
            kinds = [MetricTotals.kind(k) for k in keys]
            device = self.runner.comm_device()
            values = torch.tensor([totals.sums[k] for k in keys], dtype=torch.float64, device=device)
            group = self.dims.group("dp")

            def where(kind: set[str], fill: float) -> torch.Tensor:
                return torch.where(torch.tensor([k in kind for k in kinds], device=device), values, fill)

            sums, highs, lows = where({"sum", "mean"}, 0.0), where({"max"}, -1e300), where({"min"}, 1e300)
            if self.dims.dp > 1:
                dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
                dist.all_reduce(highs, op=dist.ReduceOp.MAX, group=group)
                dist.all_reduce(lows, op=dist.ReduceOp.MIN, group=group)
            merged = MetricTotals()
            for i, (key, kind) in enumerate(zip(keys, kinds)):
                merged.sums[key] = float({"max": highs, "min": lows}.get(kind, sums)[i])
            merged.tokens = merged.sums.get("pg/tokens", 0.0)
            result = merged.result()
        if self.dims.pp > 1:
            box = [result]
            last = self.dims.members["pp"][-1]
            dist.broadcast_object_list(box, src=last, group=self.dims.group("pp"))
            result = box[0]
        assert result is not None
        return result


@torch.no_grad()
def prepare(
    policy: ParallelPolicy,
    batch: RolloutBatch,
    cfg: PPOConfig,
    temperature: float,
    group_size: int,
    reference: ParallelPolicy | None = None,
    algorithm: AlgorithmConfig | None = None,
    kl_reward_coef: float | None = None,
    critic: ParallelPolicy | None = None,
    replay: MoEReplayConfig | None = None,
) -> tuple[RolloutBatch, dict[str, float]]:
    """`learner.prepare` on the parallel policy: the prepared whole batch, identical on every rank.
    `critic`: the value model (`rl.critic`) whose values gae needs. `replay` (router replay): with r3 the
    batch carries the engine's routing, replayed in every pass, and the metrics say how often the learner
    would have routed otherwise (`replay/flip_frac*`) and, with `replay_metrics`, the mismatch without
    replay (`replay/mismatch_off_*`); with r2 the old-policy pass records its routing into the batch."""
    mode = "none" if replay is None else replay.router_replay
    ref = None if reference is None else (lambda b: reference.logprobs(b, temperature))
    values = None if critic is None else (lambda b: critic.logprobs(b, 1.0))
    extra: dict[str, float] = {}
    captured: list[torch.Tensor] = []
    if mode == "r3" and batch.routing is not None:

        def logprobs_of(b: RolloutBatch) -> torch.Tensor:
            lp, counts = policy.replay_flips(b, temperature)
            extra.update(flip_metrics(counts))
            return lp

        if replay is not None and replay.replay_metrics:
            free = policy.logprobs(batch.with_(routing=None), temperature)
            extra.update(mismatch_stats(free, batch.rollout_logprobs, batch.loss_mask, "replay/mismatch_off"))
    elif mode == "r2":

        def logprobs_of(b: RolloutBatch) -> torch.Tensor:
            lp, routing = policy.routed_logprobs(b, temperature)
            captured.append(routing)
            return lp

    else:
        logprobs_of = lambda b: policy.logprobs(b, temperature)  # noqa: E731
    prepared, metrics = prepare_with(
        logprobs_of, ref, batch, cfg, group_size, algorithm, kl_reward_coef, values
    )
    if captured:
        prepared = prepared.with_(routing=captured[0])
    return prepared, {**metrics, **extra}


def flip_metrics(counts: torch.Tensor) -> dict[str, float]:
    """`replay/flip_frac` (replayed tokens whose experts differ from the learner's own choice, over all
    layers) and `replay/flip_frac_layer{i}` from per-layer (differing, replayed) counts [layers, 2]."""
    total = counts.sum(0).double()
    out = {"replay/flip_frac": float(total[0] / total[1].clamp(min=1)), "replay/tokens": float(total[1])}
    for i, (diff, n) in enumerate(counts.double().tolist()):
        out[f"replay/flip_frac_layer{i}"] = diff / max(n, 1.0)
    return out


def mismatch_stats(learner: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor, prefix: str) -> dict:
    """Mean and largest |learner - engine| log-prob over the loss tokens, as `{prefix}_abs_diff_*`."""
    diff = (learner - engine).abs()[mask > 0]
    if diff.numel() == 0:
        return {}
    mean, largest = float(diff.double().mean()), float(diff.max())
    return {f"{prefix}_abs_diff_mean": mean, f"{prefix}_abs_diff_max": largest}


def update(
    policy: ParallelPolicy, batch: RolloutBatch, cfg: PPOConfig, temperature: float, generator=None
) -> dict[str, float]:
    """`learner.update` on the parallel policy: PPO epochs over mini-batches (the same shuffle on every
    rank: `generator` seeded alike), one distributed-optimizer step each. Metrics on every rank."""
    if policy.optimizer is None:
        raise ValueError("update needs a ParallelPolicy with an optimizer")
    optimizer = policy.optimizer

    def step(mini: RolloutBatch, on_policy: bool) -> dict[str, float]:
        metrics = policy.accumulate_gradients(mini, cfg, temperature, on_policy)
        metrics.update(optimizer.step())
        return metrics

    return run_epochs(batch, cfg, generator, step)


def supervised_step(
    policy: ParallelPolicy,
    batch: RolloutBatch,
    micro_batches: int,
    vocab_sample: VocabSample | None = None,
) -> dict[str, float]:
    """One supervised optimizer step: the token-mean negative log-likelihood (temperature 1) of `batch`'s
    loss tokens, normalised by the loss tokens of the whole batch over all replicas (collective). Metrics:
    `sft/loss` (the mean NLL, also as `loss/total`), `sft/tokens` and the optimizer's, on every rank.
    With `vocab_sample` (holding every loss target of `batch`) the NLL is that of the sampled softmax over its
    rows (`model.sampled_softmax`); the output layer must be whole on the rank (tensor parallel 1)."""
    if policy.optimizer is None:
        raise ValueError("supervised_step needs a ParallelPolicy with an optimizer")
    mine = batch.select(policy.my_rows(len(batch)))
    device = policy.runner.comm_device()
    denom = loss_denominators([mine.loss_mask.to(device)], policy.dims.group("dp"))
    packed = policy.pack(mine, micro_batches)
    totals = MetricTotals()

    def loss_fn(rows: torch.Tensor, logprobs: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
        if not len(rows):  # a filler micro-batch: a zero tied to the graph, no metrics
            return logprobs.sum() * 0.0
        mask = to_device(mine.loss_mask[rows.cpu()], logprobs.device)
        loss = -(logprobs * mask).sum() / denom.tokens
        totals.add({"loss/nll": loss.detach(), "pg/tokens": mask.sum()})
        return loss

    with policy.runner.scoring(vocab_sample):
        policy.runner.forward_backward(packed, loss_fn, 1.0)
    combined = policy._combine(totals)
    loss = combined["loss/nll"]
    metrics = {"sft/loss": loss, "loss/total": loss, "sft/tokens": combined["pg/tokens"]}
    metrics.update(policy.optimizer.step())
    return metrics
