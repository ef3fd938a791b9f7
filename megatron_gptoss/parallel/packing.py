"""Packed micro-batches: whole documents packed into rows of a token budget on the host, with each
micro-batch's document boundaries (`cu_seqlens`) computed there, and the gathers that map packed values
back to the source rows with index tensors built on the host (no data-dependent sync on the device).
`parallel.pipeline` runs them through the stages."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_gptoss.model.moe import no_route
from megatron_gptoss.utils.host import to_device


def cu_seqlens_from_positions(positions: Tensor) -> tuple[Tensor, int]:
    """Document boundaries of packed tokens: positions [..., N] restart at 0 at each document (the
    first token always starts one) -> (cu_seqlens int32 [docs + 1] over the flattened tokens, max length)."""
    flat = positions.reshape(-1)
    starts = (flat == 0).nonzero().reshape(-1)
    if starts.numel() == 0 or int(starts[0]) != 0:
        starts = torch.cat([starts.new_zeros(1), starts])
    cu = torch.cat([starts, starts.new_full((1,), flat.numel())]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


@dataclass
class PackedBatch:
    """Rows of a right-padded batch [B, T] (one document each) packed into M micro-batches of N tokens.

    Micro-batch m holds the documents `rows[m]` in order, then one filler document (token 0) up to N.
    `row_of[m, j]` / `col_of[m, j]` give the source row and column of token j (-1 for filler)."""

    input_ids: Tensor  # [M, N] int64
    positions: Tensor  # [M, N] int64
    targets: Tensor  # [M, N] int64
    rows: list[Tensor]  # M tensors of source row indices
    row_of: Tensor  # [M, N] int64
    col_of: Tensor  # [M, N] int64
    local_row_of: Tensor  # [M, N] int64: index into rows[m], -1 for filler
    shape: tuple[int, int]  # (B, T)
    routing: Tensor | None = None  # [M, N, layers, k]: router replay's experts (`moe.no_route` for filler)
    # per micro-batch on the host: (cu_seqlens int32 [docs + 1], longest document), from the positions
    boundaries: list[tuple[Tensor, int]] | None = None

    @property
    def num_micro_batches(self) -> int:
        return self.input_ids.shape[0]

    @property
    def token_budget(self) -> int:
        return self.input_ids.shape[1]

    def micro_boundaries(self, m: int) -> tuple[Tensor, int]:
        """Micro-batch m's document boundaries on the host: (cu_seqlens int32 [docs + 1], longest)."""
        if self.boundaries is None:
            return cu_seqlens_from_positions(self.positions[m].cpu())
        return self.boundaries[m]

    def boundary_tensors(self) -> tuple[Tensor, Tensor]:
        """Every micro-batch's boundaries as host tensors the pp schedules can split by micro-batch:
        cu_seqlens int32 [M, D + 1] (padded with the token budget) and the longest document int64 [M]."""
        pairs = [self.micro_boundaries(m) for m in range(self.num_micro_batches)]
        width = max(len(cu) for cu, _ in pairs)
        cu = torch.full((len(pairs), width), self.token_budget, dtype=torch.int32)
        for m, (bounds, _) in enumerate(pairs):
            cu[m, : len(bounds)] = bounds
        return cu, torch.tensor([longest for _, longest in pairs], dtype=torch.long)

    def micro_rows(self, m: int, values: Tensor) -> Tensor:
        """Values of micro-batch m's tokens ([N] or [1, N]) as [len(rows[m]), T] (0 at padding);
        differentiable in `values`. The gather's indices are built on the host (no data-dependent
        sync on `values`' device)."""
        values = values.reshape(-1)
        keep = (self.local_row_of[m] >= 0).cpu()
        slots = keep.nonzero().reshape(-1)
        rows, cols = self.local_row_of[m].cpu()[slots], self.col_of[m].cpu()[slots]
        out = values.new_zeros(len(self.rows[m]), self.shape[1])
        device = values.device
        picked = values.index_select(0, to_device(slots, device))
        return out.index_put((to_device(rows, device), to_device(cols, device)), picked)

    def unpack(self, values: Tensor) -> Tensor:
        """Values [M, N] of every packed token -> [B, T] in the source layout (0 at padding), gathered
        with indices built on the host."""
        keep = (self.row_of >= 0).cpu().reshape(-1)
        slots = keep.nonzero().reshape(-1)
        rows, cols = self.row_of.cpu().reshape(-1)[slots], self.col_of.cpu().reshape(-1)[slots]
        device = values.device
        picked = values.reshape(-1).index_select(0, to_device(slots, device))
        return values.new_zeros(self.shape).index_put(
            (to_device(rows, device), to_device(cols, device)), picked
        )


def pack_micro_batches(
    input_ids: Tensor,
    targets: Tensor,
    valid: Tensor,
    token_budget: int,
    min_micro_batches: int = 1,
    multiple_of: int = 1,
    routing: Tensor | None = None,
) -> PackedBatch:
    """Pack the rows of input_ids / targets / valid [B, T] (valid: a prefix of each row) in order into
    micro-batches of `token_budget` tokens, greedily; at least `min_micro_batches`, a multiple of
    `multiple_of` (filler-only micro-batches are added). A row longer than the budget is an error.
    `routing` [B, T, layers, k] (router replay) is packed alike."""
    lengths = valid.sum(1).tolist()
    for b, n in enumerate(lengths):
        if n > token_budget:
            raise ValueError(f"row {b} has {n} tokens, more than the micro-batch token budget {token_budget}")
        if not bool(valid[b, :n].all()):
            raise ValueError(f"row {b}: valid tokens must be a prefix of the row")
    groups: list[list[int]] = []
    fill = token_budget
    for b, n in enumerate(lengths):
        if n == 0:
            continue
        if fill + n > token_budget:
            groups.append([])
            fill = 0
        groups[-1].append(b)
        fill += n
    count = max(len(groups), min_micro_batches, 1)
    count = -(-count // multiple_of) * multiple_of
    groups += [[] for _ in range(count - len(groups))]

    shape = (count, token_budget)
    ids = torch.zeros(shape, dtype=torch.long)
    tgt = torch.full(shape, -1, dtype=torch.long)  # -1: no log-prob needed (padding)
    pos = torch.zeros(shape, dtype=torch.long)
    row_of = torch.full(shape, -1, dtype=torch.long)
    col_of = torch.full(shape, -1, dtype=torch.long)
    local = torch.full(shape, -1, dtype=torch.long)
    src_ids, src_tgt = input_ids.cpu(), targets.cpu()
    for m, group in enumerate(groups):
        at = 0
        for i, b in enumerate(group):
            n = lengths[b]
            ids[m, at : at + n] = src_ids[b, :n]
            tgt[m, at : at + n] = src_tgt[b, :n]
            pos[m, at : at + n] = torch.arange(n)
            row_of[m, at : at + n] = b
            col_of[m, at : at + n] = torch.arange(n)
            local[m, at : at + n] = i
            at += n
        pos[m, at:] = torch.arange(token_budget - at)
    rows = [torch.tensor(g, dtype=torch.long) for g in groups]
    packed_routing = None
    if routing is not None:
        keep = row_of >= 0
        fill = no_route(routing.dtype)
        packed_routing = torch.full((*shape, *routing.shape[2:]), fill, dtype=routing.dtype)
        packed_routing[keep] = routing.cpu()[row_of[keep], col_of[keep]]
    shape_bt = (valid.shape[0], valid.shape[1])
    boundaries = [cu_seqlens_from_positions(pos[m]) for m in range(count)]  # host tensors: no sync
    return PackedBatch(ids, pos, tgt, rows, row_of, col_of, local, shape_bt, packed_routing, boundaries)
