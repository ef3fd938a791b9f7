"""Rollout batches: prompt + response token rows, their loss mask and per-token RL tensors, and the
packed forward that computes per-token log-probs without padding.

Row b holds sequence s = prompt + response as `input_ids = s[:-1]`, `targets = s[1:]`, right-padded.
`loss_mask[b, t]` is 1 when `targets[b, t]` was written by the policy (response tokens; tool and
environment tokens carry 0). For the model the valid tokens of all rows are packed into one row with
per-document positions and `cu_seqlens`, so padding costs no compute.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from megatron_gptoss.model.moe import no_route


@dataclass
class RolloutBatch:
    input_ids: torch.Tensor  # [B, T] int64
    targets: torch.Tensor  # [B, T] int64
    valid: torch.Tensor  # [B, T] bool: real (unpadded) positions
    loss_mask: torch.Tensor  # [B, T] float32: targets written by the policy
    rollout_logprobs: torch.Tensor  # [B, T] float32, the engine's log-probs of the targets (0 elsewhere)
    rewards: torch.Tensor  # [B] float32
    advantages: torch.Tensor | None = None  # [B] (one per sequence) or [B, T] (per token) float32
    old_logprobs: torch.Tensor | None = None  # [B, T] learner log-probs before the update (loss tokens)
    ref_logprobs: torch.Tensor | None = None  # [B, T] reference-policy log-probs (loss tokens)
    is_weights: torch.Tensor | None = None  # [B, T] rollout-correction weights
    values: torch.Tensor | None = None  # [B, T] the critic's values before the update (gae)
    returns: torch.Tensor | None = None  # [B, T] the critic's targets (gae)
    # [B, T, layers, k] router replay: the experts of input token t at every layer (`moe.no_route` where
    # it routes itself); the engine's (r3) or the old policy's (r2)
    routing: torch.Tensor | None = None
    # [B, T] int64 the policy version that sampled each target (asynchronous rollouts; -1 where none did)
    versions: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, index: torch.Tensor | slice) -> RolloutBatch:
        """Rows `index` of every tensor field (None stays None)."""
        values = {
            f.name: (None if getattr(self, f.name) is None else getattr(self, f.name)[index])
            for f in fields(self)
        }
        return RolloutBatch(**values)  # type: ignore[arg-type]

    def with_(self, **changes) -> RolloutBatch:
        return replace(self, **changes)


def build_batch(
    prompts: list[list[int]],
    responses: list[list[int]],
    rollout_logprobs: list[list[float]],
    rewards: list[float],
    response_masks: list[list[int]] | None = None,
    routing: list[torch.Tensor | None] | None = None,
    versions: list[list[int]] | None = None,
) -> RolloutBatch:
    """Rows from token lists. `response_masks[b][i]` = 0 marks response token i as written by a tool or
    the environment (excluded from the loss and the correction statistics); default all 1. `routing[b]`:
    the engine's experts of row b's input tokens [len(prompt) + len(response) - 1, layers, k] (router
    replay), or None where a row routes itself. `versions[b][i]`: the policy version that sampled response
    token i of row b (-1 at every other position)."""
    if not (len(prompts) == len(responses) == len(rollout_logprobs) == len(rewards)):
        raise ValueError("prompts, responses, rollout_logprobs and rewards must have one entry per row")
    rows = len(prompts)
    width = max(len(p) + len(r) - 1 for p, r in zip(prompts, responses))
    input_ids = torch.zeros(rows, width, dtype=torch.long)
    targets = torch.zeros(rows, width, dtype=torch.long)
    valid = torch.zeros(rows, width, dtype=torch.bool)
    loss_mask = torch.zeros(rows, width)
    rollout = torch.zeros(rows, width)
    for b, (prompt, response, lps) in enumerate(zip(prompts, responses, rollout_logprobs)):
        if len(lps) != len(response):
            raise ValueError(f"row {b}: {len(response)} response tokens but {len(lps)} log-probs")
        seq = list(prompt) + list(response)
        n = len(seq) - 1
        input_ids[b, :n] = torch.tensor(seq[:-1])
        targets[b, :n] = torch.tensor(seq[1:])
        valid[b, :n] = True
        start = len(prompt) - 1
        mask = response_masks[b] if response_masks is not None else [1] * len(response)
        loss_mask[b, start : start + len(response)] = torch.tensor(mask, dtype=torch.float32)
        rollout[b, start : start + len(response)] = torch.tensor(lps, dtype=torch.float32)
    batch = RolloutBatch(
        input_ids, targets, valid, loss_mask, rollout, torch.tensor(rewards, dtype=torch.float32)
    )
    if versions is not None:
        table = torch.full((rows, width), -1, dtype=torch.long)
        for b, (prompt, row) in enumerate(zip(prompts, versions)):
            if len(row) != len(responses[b]):
                raise ValueError(f"row {b}: {len(responses[b])} response tokens but {len(row)} versions")
            table[b, len(prompt) - 1 : len(prompt) - 1 + len(row)] = torch.tensor(row, dtype=torch.long)
        batch.versions = table
    known = [r for r in routing or [] if r is not None]
    if known:
        table = torch.full((rows, width, *known[0].shape[1:]), no_route(known[0].dtype), dtype=known[0].dtype)
        for b, r in enumerate(routing or []):
            if r is not None:
                n = int(valid[b].sum())
                if r.shape[0] != n:
                    raise ValueError(f"row {b}: routing of {r.shape[0]} tokens for {n} input tokens")
                table[b, :n] = r
        batch.routing = table
    return batch


def packed_logprobs(
    model, batch: RolloutBatch, temperature: float, chunk_size: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs and entropy [B, T] of the loss tokens (0 elsewhere: prompt, tool and padding
    positions skip the output layer) from one packed forward of the valid tokens."""
    lengths = batch.valid.sum(1)
    device = next(model.parameters()).device
    flat_ids = batch.input_ids[batch.valid].to(device)
    positions = torch.cat([torch.arange(int(n)) for n in lengths]).to(device)
    cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu_seqlens[1:] = lengths.cumsum(0)
    hidden = model.hidden_states(
        flat_ids[None],
        position_ids=positions[None],
        cu_seqlens=cu_seqlens.to(device),
        max_seqlen=int(lengths.max()),
        routing=None if batch.routing is None else batch.routing[batch.valid].to(device),
    )[0]
    targets = batch.targets.masked_fill(batch.loss_mask == 0, -1)[batch.valid]
    lp, ent = model.token_logprobs(hidden, targets.to(device), temperature, chunk_size)
    valid = batch.valid.to(device)
    zeros = torch.zeros(valid.shape, dtype=lp.dtype, device=device)
    return zeros.masked_scatter(valid, lp), zeros.masked_scatter(valid, ent)
