"""The embedded engine's scheduler: which tokens of which sequences one forward computes, and their KV blocks.

    waiting ──admit (free slots, its blocks reserved)───> running ──a stop token / its turn's budget──> out
       ^                                                    │        (a generation: blocks freed; a session:
       └──────────── extend_session (a session resumes) ────┘         paused, it keeps its blocks)

    admission (continuous): while rows run, waiting sequences join together once `admit_batch` slots are
    free (or as many as wait) or a slot has stood free `admit_wait` steps (`admission_due`)
    one step (continuous): every running sequence whose tokens are all in the cache decodes one token; the
    rest of `max_step_tokens` goes to prefill chunks, oldest first. A sequence whose last known token was
    computed in this step samples its next token from that token's hidden state. A step with prefill tokens
    is laid out flat for the engine's graphs (every token a row of one query: `flat_tokens`, `_flat`).
    one step (static): a batch of up to `max_batch_slots` prompts is admitted only when none runs, each
    prefilled whole in one step; finished rows keep decoding (their samples discarded) until the batch's
    last row finishes; then every block of the batch is freed.

Blocks: a sequence's quota in each pool is reserved at admission (the most blocks it can hold at once: its
full length for full attention, its window plus one chunk for a sliding-window group), so a running sequence
never waits for a block. A sliding-window group releases a block once every position in it lies before the
window of the next query.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from megatron_gptoss.config.engine import EmbeddedEngineConfig
from megatron_gptoss.config.memory import window_row_blocks
from megatron_gptoss.engine_api.protocol import SamplingParams
from megatron_gptoss.errors import EngineError
from megatron_gptoss.model.paged_kv_cache import AttentionGroup, BlockPool, PagedKVCache, StepLayout

# Tokens: a sliding-window view starts at a multiple of this, a multiple of every attention kernel's tile
# (at most 128), so a prefill chunk's rows are tiled as in the training forward, equal to its rows bitwise.
VIEW_ALIGN = 128
# A step with prefill tokens is laid out flat (every token a row of one query: `Scheduler.flat_tokens`) only
# where its prefill tokens see at most this many keys on average in their views: the paged decode kernel
# reads each row's keys itself, so a long prompt's chunk is left to the chunked attention of an eager step
# (a bound chosen from that reading, not timed: the prompts measured saw about 100 keys).
FLAT_KEYS_PER_TOKEN = 1024


@dataclass(eq=False)
class Sequence:
    """One trajectory. The seeded sampler draws its next token at counter `len(tokens) - counter_base`."""

    sid: int
    tokens: list[int]
    params: SamplingParams
    # the row's sampler seed (None: the engine's running generator)
    seed: int | None
    counter_base: int
    # tokens this turn may still sample
    budget: int
    # tokens whose keys and values are in the cache
    computed: int = 0
    tables: list[list[int]] = field(default_factory=list)
    # per pool: the most blocks this sequence may hold at once (reserved at admission)
    quota: list[int] = field(default_factory=list)
    # per pool: leading table entries already released by a sliding window
    released: list[int] = field(default_factory=list)
    out_tokens: list[int] = field(default_factory=list)
    out_logprobs: list[float] = field(default_factory=list)
    # the engine's policy version when each of out_tokens was sampled
    out_versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    # static schedule: finished, still decoding until its batch ends (samples discarded)
    ghost: bool = False
    # a generation that left the scheduler (its blocks freed)
    left: bool = False
    # router replay: top-k expert ids [tokens, layers, k] of the tokens computed this turn
    routing: list[torch.Tensor] = field(default_factory=list)

    def held(self, pool: int) -> int:
        return sum(1 for block in self.tables[pool] if block != 0)


@dataclass
class Chunk:
    """`count` tokens of `seq` from position `start`, at `offset` in the packed tokens of the step."""

    seq: Sequence
    start: int
    count: int
    offset: int


@dataclass
class StepPlan:
    chunks: list[Chunk]
    input_ids: torch.Tensor  # [1, N]
    positions: torch.Tensor  # [1, N]
    layout: StepLayout
    samplers: list[Chunk]  # chunks whose sequence samples its next token after this step


def staged(values: list[int], device: torch.device) -> torch.Tensor:
    """int64 `values` on `device`: on a GPU through pinned host memory and one non-blocking copy (the caching
    host allocator keeps the pinned block until the copy has run)."""
    host = torch.from_numpy(np.asarray(values, dtype=np.int64))  # numpy converts a list of ints fast
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class _Staging:
    """The int64 arrays of one step, built on the host and copied to the device together."""

    def __init__(self) -> None:
        self.values: list[int] = []
        self.shapes: list[tuple[int, int]] = []  # (start, row width: 0 for a flat array)

    def add(self, flat: list[int], width: int = 0) -> int:
        """Append an array (rows of `width` when > 0); returns its handle for `upload`'s result."""
        self.shapes.append((len(self.values), width))
        self.values.extend(flat)
        return len(self.shapes) - 1

    def upload(self, device: torch.device) -> list[torch.Tensor]:
        """Every array as a view of one device tensor, in the order added."""
        flat = staged(self.values, device)
        ends = [start for start, _ in self.shapes[1:]] + [len(self.values)]
        views = []
        for (start, width), end in zip(self.shapes, ends):
            part = flat[start:end]
            views.append(part.view(-1, width) if width else part)
        return views


class Scheduler:
    """Running, waiting and paused sequences over one `PagedKVCache`. `growable`: the pools grow between
    steps when a sequence cannot be admitted (the cache was sized by the engine, not fixed by the user)."""

    def __init__(self, cache: PagedKVCache, options: EmbeddedEngineConfig, growable: bool, device):
        self.cache, self.options, self.growable = cache, options, growable
        self.device = torch.device(device)
        self.static = options.schedule == "static"
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.steps = 0  # steps computed (`computed`): the clock of `admit_wait`
        # Steps with prefill tokens of at most this many tokens in all are laid out flat (`_build`), for the
        # engine's graphs of such steps (0: never; the engine sets it before each step)
        self.flat_tokens = 0
        self._free_since: int | None = None  # the step since which a slot stands free while sequences wait

    @property
    def pools(self) -> list[BlockPool]:
        return self.cache.pools

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        if not seq.tables:
            seq.tables = [[] for _ in self.pools]
            seq.released = [0 for _ in self.pools]
            seq.quota = [0 for _ in self.pools]
        self.waiting.append(seq)

    # ------------------------------------------------------------------------------------------------
    def _quota(self, seq: Sequence, pool: BlockPool, chunk: int) -> int:
        full = math.ceil((len(seq.tokens) + seq.budget) / pool.block_size)
        if pool.window is None:
            return full
        return min(full, window_row_blocks(pool.window, chunk, pool.block_size))

    def _outstanding(self, index: int) -> int:
        """Blocks reserved by running sequences and not yet allocated, in pool `index`."""
        return sum(max(0, s.quota[index] - s.held(index)) for s in self.running)

    def _try_reserve(self, seq: Sequence, outstanding: list[int]) -> bool:
        """Reserve the sequence's quota in every pool (growing a growable pool); False if it does not fit.
        `outstanding`: `_outstanding` of every pool, with the reservation added where it is made."""
        pending = len(seq.tokens) - seq.computed
        chunk = pending if self.static else min(pending, self.options.max_step_tokens)
        quotas = [self._quota(seq, pool, max(chunk, 1)) for pool in self.pools]
        adds = [max(0, quotas[i] - seq.held(i)) for i in range(len(self.pools))]
        for i, pool in enumerate(self.pools):
            need = adds[i] + outstanding[i] - len(pool.free)
            if need > 0:
                if quotas[i] > pool.capacity and not self.growable:
                    raise EngineError(
                        f"a sequence of {len(seq.tokens) + seq.budget} tokens needs {quotas[i]} KV blocks of "
                        f"{pool.block_size} in one layer group; the cache holds {pool.capacity} "
                        "(raise embedded.kv_blocks)"
                    )
                if not self.growable:
                    return False
        for i, pool in enumerate(self.pools):  # every pool fits (or grows): commit
            need = adds[i] + outstanding[i] - len(pool.free)
            if need > 0:
                pool.grow(max(need, pool.capacity))
            seq.quota[i] = quotas[i]
            outstanding[i] += adds[i]
        return True

    def admission_due(self) -> bool:
        """Whether waiting sequences are admitted at the next step (continuous): at once when nothing runs;
        while rows run, once `admit_slots()` slots are free (or as many as wait, when fewer) or a slot has
        stood free for `admit_wait` steps. The free slots only change when a row stops, which also drops a
        plan built ahead."""
        free = self.options.max_batch_slots - len(self.running)
        if not self.waiting or free <= 0:
            self._free_since = None
            return False
        if self._free_since is None:
            self._free_since = self.steps
        if not self.running or free >= min(self.options.admit_slots(), len(self.waiting)):
            return True
        return self.steps - self._free_since >= self.options.admit_wait

    def admit(self) -> None:
        if self.static and self.running:
            return
        if not self.static and not self.admission_due():
            return
        outstanding = [self._outstanding(i) for i in range(len(self.pools))]  # once a step, kept up to date
        while self.waiting and len(self.running) < self.options.max_batch_slots:
            if not self._try_reserve(self.waiting[0], outstanding):
                if not self.running:
                    raise EngineError("the KV cache cannot hold one waiting sequence with nothing running")
                return
            self.running.append(self.waiting.popleft())

    # ------------------------------------------------------------------------------------------------
    def plan(self) -> StepPlan | None:
        """Admit what is due and fits, choose this step's chunks, allocate their blocks, build the packed
        layout."""
        self.admit()
        if not self.running:
            return None
        chunks: list[Chunk] = []
        budget = self.options.max_step_tokens
        decoding = [s for s in self.running if len(s.tokens) - s.computed == 1]
        prefilling = [s for s in self.running if len(s.tokens) - s.computed > 1]
        offset = 0
        for seq in decoding + prefilling:
            pending = len(seq.tokens) - seq.computed
            count = pending if self.static else min(pending, budget)
            if count <= 0:
                break  # continuous only: decoding rows come first and the budget covers every slot
            chunks.append(Chunk(seq, seq.computed, count, offset))
            offset += count
            budget -= count
        for chunk in chunks:
            self._allocate(chunk.seq, chunk.start + chunk.count)
        return self._build(chunks)

    def plan_ahead(self) -> StepPlan | None:
        """The next decode step's plan, built while the current one runs on the device, as if every running
        row samples one more token and goes on (None where that cannot hold: a static schedule, waiting
        sequences due for admission then, a row still prefilling or at its last token). Its token ids are
        placeholders (0): the engine writes the sampled ones before it uses the plan, and drops it where a
        row stopped or admission came due."""
        if self.static or not self.running or self.admission_due():
            return None
        if any(len(s.tokens) != s.computed or s.budget < 2 for s in self.running):
            return None
        chunks = [Chunk(seq, seq.computed, 1, row) for row, seq in enumerate(self.running)]
        for chunk in chunks:
            self._allocate(chunk.seq, chunk.start + 1)
        return self._build(chunks, ahead=True)

    def _allocate(self, seq: Sequence, length: int) -> None:
        """Blocks for positions < length in every pool's table."""
        for i, pool in enumerate(self.pools):
            table = seq.tables[i]
            while len(table) * pool.block_size < length:
                if seq.held(i) < seq.quota[i]:
                    table.append(pool.allocate())
                elif seq.ghost:  # past its own length in a static batch: its writes go to the null block
                    table.append(0)
                else:
                    raise RuntimeError(f"sequence {seq.sid} exceeds its block quota in pool {i}")

    def _flat(self, chunks: list[Chunk]) -> bool:
        """Whether a step of `chunks` is laid out flat: continuous, some chunk prefills, at most `flat_tokens`
        tokens, and its prefill tokens see at most `FLAT_KEYS_PER_TOKEN` keys on average (positions + 1
        bound what their views show)."""
        if self.static or not self.flat_tokens or all(c.count == 1 for c in chunks):
            return False
        tokens = sum(c.count for c in chunks)
        prefill = [c for c in chunks if c.count > 1]
        keys = sum(c.count * (2 * c.start + c.count + 1) // 2 for c in prefill)
        return tokens <= self.flat_tokens and keys <= FLAT_KEYS_PER_TOKEN * sum(c.count for c in prefill)

    def _build(self, chunks: list[Chunk], ahead: bool = False) -> StepPlan:
        """The packed layout of `chunks`; `ahead`: one placeholder token per chunk (`plan_ahead`). Laid out
        flat (`_flat`), every token is a row of one query in one attention group, its block tables those of
        its chunk (gathered on the device), as a decode step of that many rows."""
        bs = self.cache.block_size
        flat = not ahead and self._flat(chunks)
        host = _Staging()
        if ahead:
            ids = host.add([0] * len(chunks))
        else:
            ids = host.add([t for c in chunks for t in c.seq.tokens[c.start : c.start + c.count]])
        pos = host.add([p for c in chunks for p in range(c.start, c.start + c.count)])
        slots = [
            host.add(
                [
                    c.seq.tables[i][p // bs] * bs + p % bs
                    for c in chunks
                    for p in range(c.start, c.start + c.count)
                ]
            )
            for i in range(len(self.pools))
        ]
        tokens = sum(c.count for c in chunks)
        groups, inverse = [], [0] * tokens
        row_base = 0
        sets = [chunks] if flat else [[c for c in chunks if c.count == 1], [c for c in chunks if c.count > 1]]
        for members in sets:
            if not members:
                continue
            t = 1 if flat else max(c.count for c in members)
            index, pads = [], [max(0, t - c.count) for c in members]
            for r, (c, pad) in enumerate(zip(members, pads)):
                index += [c.offset] * pad + list(range(c.offset, c.offset + c.count))
                for j in range(c.count):
                    inverse[c.offset + j] = row_base + (c.offset + j if flat else r * t + pad + j)
            # flat: each token's row of the tables is its chunk's, gathered on the device after the upload
            of_chunk = host.add([r for r, c in enumerate(members) for _ in range(c.count)]) if flat else None
            tables, qpos, kv_slots = [], [], []
            for i in range(len(self.pools)):
                # a sliding-window pool's view starts at or before the row's first unreleased block, at a
                # multiple of VIEW_ALIGN tokens (positions shift; released entries read the null block)
                step = math.lcm(bs, VIEW_ALIGN) // bs
                first = [c.seq.released[i] - c.seq.released[i] % step for c in members]
                width = max(math.ceil((c.start + c.count) / bs) - f for c, f in zip(members, first))
                rows = [c.seq.tables[i][f : f + width] for c, f in zip(members, first)]
                tables.append(host.add([b for row in rows for b in row + [0] * (width - len(row))], width))
                shifted = [
                    q
                    for c, f, pad in zip(members, first, pads)
                    for q in [-1] * pad + [p - f * bs for p in range(c.start, c.start + c.count)]
                ]
                qpos.append(host.add(shifted, t))
                kv_slots.append(width * bs)
            groups.append((host.add(index, t), qpos, tables, kv_slots, of_chunk))
            row_base += tokens if flat else len(members) * t
        inv = host.add(inverse)
        staged = host.upload(self.device)

        def rows_of(handle: int, of_chunk: int | None) -> torch.Tensor:
            return staged[handle] if of_chunk is None else staged[handle].index_select(0, staged[of_chunk])

        layout = StepLayout(
            [staged[s] for s in slots],
            [
                AttentionGroup(staged[index], [staged[q] for q in qp], [rows_of(x, oc) for x in tb], kv)
                for index, qp, tb, kv, oc in groups
            ],
            staged[inv],
            in_order=flat or all(c.count == 1 and c.offset == i for i, c in enumerate(chunks)),
        )
        samplers = chunks if ahead else [c for c in chunks if c.start + c.count == len(c.seq.tokens)]
        return StepPlan(chunks, staged[ids].view(1, -1), staged[pos].view(1, -1), layout, samplers)

    def idle_plan(self) -> StepPlan:
        """One padding token written into the null block (a rank with nothing to do that must still join
        its lockstep block's forward)."""
        zero = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        every = [zero for _ in self.pools]
        group = AttentionGroup(zero, every, every, [self.cache.block_size for _ in self.pools])
        layout = StepLayout([zero[0] for _ in self.pools], [group], zero[0])
        return StepPlan([], zero, zero, layout, [])

    # ------------------------------------------------------------------------------------------------
    def computed(self, plan: StepPlan, chunks: list[Chunk] | None = None) -> None:
        """Account the step's chunks (`chunks` of them only: a step launched ahead, its rows that stopped
        meanwhile left out) and release sliding-window blocks no later query can see."""
        self.steps += 1
        for chunk in plan.chunks if chunks is None else chunks:
            seq = chunk.seq
            seq.computed = chunk.start + chunk.count
            self._slide(seq)

    def _slide(self, seq: Sequence) -> None:
        for i, pool in enumerate(self.pools):
            if pool.window is None:
                continue
            first_visible = seq.computed - pool.window + 1  # of the next query, at position `computed`
            table = seq.tables[i]
            while seq.released[i] < len(table) and (seq.released[i] + 1) * pool.block_size <= first_visible:
                pool.release(table[seq.released[i]])
                table[seq.released[i]] = 0
                seq.released[i] += 1

    def stop(self, seq: Sequence, keep_blocks: bool) -> None:
        """`seq` leaves the running set: a paused session keeps its blocks, anything else frees them."""
        self.running.remove(seq)
        seq.quota = [seq.held(i) for i in range(len(self.pools))] if keep_blocks else seq.quota
        if not keep_blocks:
            self.free(seq)

    def free(self, seq: Sequence) -> None:
        for i, pool in enumerate(self.pools):
            for block in seq.tables[i]:
                pool.release(block)
            seq.tables[i], seq.released[i], seq.quota[i] = [], 0, 0

    def recompute(self) -> int:
        """Every unfinished generation row (not a session) forgets its cache and waits, ahead of the rows
        that never ran, in its order, to be prefilled again: the next steps compute its prefix with the
        weights of now. Returns the number of rows sent back."""
        rows = [s for s in self.running if s.sid < 0 and not s.left and not s.ghost]
        rows += [s for s in self.waiting if s.sid < 0 and s.computed > 0]
        for seq in rows:
            if seq in self.running:
                self.running.remove(seq)
            else:
                self.waiting.remove(seq)
            self.free(seq)
            seq.computed = 0
        self.waiting.extendleft(reversed(rows))
        return len(rows)

    def discard(self, seq: Sequence) -> None:
        """Remove a sequence wherever it is and free its blocks (a closed session)."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.free(seq)
