"""Decode steps, and steps with prefill tokens laid out flat, replayed from CUDA graphs, one per bucket of
rows, attention-view widths and sampling.

    a decode-only step of B rows (one new token each)
      -> its bucket: batch Bb = the smallest power of two >= B (up to `max_batch`), and per KV pool a view
         width = the smallest power of two >= the step's widest block table; with `Sampling` (every row
         seeded, one temperature / top-k / top-p) also those parameters
      -> the step's token ids, positions, KV slots, block tables, query positions (and the rows' seeds and
         counters) copied into the bucket's static buffers; padding rows: token 0 at position 0, writing
         into the null block, query position -1 (they see no key and their outputs are dropped)
      -> replay the bucket's graph (captured on first use) -> final hidden states [1, Bb, H]; with
         `Sampling` the graph goes on: fp32 logits of the output layer (`head`), the seeded sampler
         (`rollout.sampling`) -> tokens and their log-probs [2, Bb] -> rows [:B]; with a routing record
         (`rollout.routing`) the routers' top-k ids into the bucket's static buffers -> rows [:B]
    a step with prefill tokens, laid out flat by the scheduler (`Scheduler.flat_tokens`: every token a row
    of one query with its chunk's block tables, N rows, N <= `max_tokens`)
      -> the same, in buckets of their own (`prefill=True`): rows Nb = the smallest power of two >= N; the
         sampling rows (each sampling chunk's last token, `Sampling.rows`) gathered into `max_samplers`
         rows (at most Nb; padding gathers row 0) before the head, so the bucket does not depend on how many
         chunks sample -> tokens and log-probs of the sampling rows, in order

Capture needs a forward without host synchronisation and without copies from the host: every input is
in the bucket's device buffers (filled before the replay), every module buffer lives on the device (the
rotary frequencies too), and the ops are the paged cache's `attend` (index copies; the Triton paged decode
kernel reading keys through the block tables, or gathers and the eager attention with a fixed view width),
the fused expert kernels (`Experts.fused`; torch._grouped_mm reads its offsets on the host for float32
weights, so a float32 engine is not captured), and the sampler's sorts, cumulative sums and searches. A
capture that fails (an op that syncs or copies from the host) turns graphs off for the engine (`failure`
says why; a step with prefill tokens: only those steps' graphs, `token_failure`) and the step runs
eagerly. Graphs hold the cache's storage and the weights' addresses: they live
as long as the cache (a grown pool, sleep or reconfigure drops them; `update_weights` copies in place and
keeps them). A bucket's first capture in the process runs `WARMUP_FORWARDS` forwards first (kernels
compiled, lazy initialisations done outside the graph); its captures after a sleep run none.

Host inputs arrive through pinned memory in non-blocking copies: the step's layout in the scheduler's one
copy, the rows' seeds and counters in one more; the bucket's buffers are filled from them on the device.

`mode` "padded" runs the same bucketed buffers eagerly, without capture: on the CPU, where no graph can be
captured, it checks the bucketing, padding and sampling against the unpadded step.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from megatron_gptoss.engine_api.protocol import SamplingParams
from megatron_gptoss.model.gpt_oss import GPTOSSModel
from megatron_gptoss.model.paged_kv_cache import AttentionGroup, PagedKVCache, StepLayout
from megatron_gptoss.ops import batch_invariant
from megatron_gptoss.rollout.routing import RoutingRecorder
from megatron_gptoss.rollout.sampling import sample_from_logits
from megatron_gptoss.rollout.scheduler import staged

log = logging.getLogger(__name__)

# forwards run before a bucket's first capture in the process (on a side stream): its kernels compiled and
# every lazy initialisation done outside the graph
WARMUP_FORWARDS = 2
# the buckets captured for each model in this process: a capture of one of them again (the graphs of a new
# cache, after a sleep or a grown pool) runs no warm-up forward; where that capture fails, it is retried
# after the warm-ups
_CAPTURED: weakref.WeakKeyDictionary[torch.nn.Module, set[tuple]] = weakref.WeakKeyDictionary()

# hidden states [B, H] -> fp32 logits [B, vocab_size]
Head = Callable[[torch.Tensor], torch.Tensor]


def _bucket(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class Sampling:
    """Seeded sampling inside a step's graph: one temperature / top-k / top-p, and per sampling row its
    stream seed and counter (`rollout.sampling.sample_from_logits`). `rows`: the packed rows that sample, in
    the order of `seeds` (a step with prefill tokens: each sampling chunk's last token); None: every row (a
    decode step)."""

    params: SamplingParams
    seeds: list[int]
    counters: list[int]
    rows: list[int] | None = None

    def key(self) -> tuple[float, int, float]:
        return (self.params.temperature, self.params.top_k, self.params.top_p)


class _Buffers:
    """Static inputs of one bucket (and, once captured, its graph and outputs)."""

    def __init__(
        self,
        batch: int,
        widths: tuple[int, ...],
        block_size: int,
        device: torch.device,
        params: SamplingParams | None,
        samplers: int | None = None,
    ):
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        self.input_ids, self.positions = zeros(1, batch), zeros(1, batch)
        self.slots = [zeros(batch) for _ in widths]
        self.q_positions = [zeros(batch, 1) - 1 for _ in widths]
        self.tables = [zeros(batch, w) for w in widths]
        # sampler inputs: seeds and counters of each sampling row (padding: 0, their draws are dropped); a
        # step with prefill tokens samples `samplers` rows (a bucket), gathered from `sample_rows`
        self.params = params
        drawn_rows = batch if samplers is None else samplers
        self.seeds, self.counters = zeros(drawn_rows), zeros(drawn_rows)
        self.sample_rows = None if samplers is None else zeros(samplers)
        index = torch.arange(batch, device=device)
        views = [w * block_size for w in widths]
        group = AttentionGroup(index.view(batch, 1), self.q_positions, self.tables, views)
        self.layout = StepLayout(self.slots, [group], index, in_order=True)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.hidden: torch.Tensor | None = None
        # [2, batch] float64: sampled tokens and their log-probs (with `params`)
        self.drawn: torch.Tensor | None = None
        # with a routing record: each layer's top-k expert ids [batch, k], written by every replay
        self.routing: dict[int, torch.Tensor] | None = None


@dataclass
class GraphStep:
    """A decode step's result on the device, not waited for: final hidden states [1, B, H] of its rows, and
    with `Sampling` the drawn tokens and their log-probs of each row, float64 [2, B]."""

    hidden: torch.Tensor
    drawn: torch.Tensor | None


class DecodeGraphs:
    """Bucketed decode forwards of `model` over `cache`. `mode`: "capture" (CUDA graphs) or "padded".
    `head`: the engine's fp32 logits of final hidden states; None keeps sampling out of the graphs.
    `routing`: the engine's routing record, given each step's routing from the bucket's static buffers."""

    def __init__(
        self,
        model: GPTOSSModel,
        cache: PagedKVCache,
        max_batch: int,
        mode: str,
        head: Head | None = None,
        routing: RoutingRecorder | None = None,
        max_tokens: int = 0,
        max_samplers: int = 1,
    ):
        self.model, self.cache, self.max_batch, self.mode, self.head = model, cache, max_batch, mode, head
        self.routing = routing
        self.device = next(model.parameters()).device
        self.enabled = True
        # why capture failed (graphs are then off), None while it has not
        self.failure: str | None = None
        # steps with prefill tokens, laid out flat (`Scheduler.flat_tokens`), of at most this many tokens
        # are replayed too (0: none); a failed capture of one turns only these off (`token_failure` says why)
        self.max_tokens = max_tokens
        self.token_failure: str | None = None
        # rows such a step samples, at most (the engine's slots): one bucket of that many gathered rows for
        # every step of a bucket of rows, so that the graphs differ by rows and view widths only
        self.max_samplers = max_samplers
        # graphs captured, and the seconds spent capturing them (warm-up forwards included), not yet taken
        self.captures, self.capture_seconds = 0, 0.0
        # warm-up forwards run before captures (`WARMUP_FORWARDS` a bucket new to the process, else none)
        self.warmups = 0
        self._buffers: dict[tuple, _Buffers] = {}
        # the buckets of steps with prefill tokens: (rows, widths, sampling, sampling rows)
        self._token_buffers: dict[tuple, _Buffers] = {}
        self._sizes = self._pool_sizes()
        self._pool = torch.cuda.graph_pool_handle() if mode == "capture" else None
        dtype = next(model.parameters()).dtype
        if mode == "capture" and dtype == torch.float32:
            self.enabled = False
            self.failure = (
                "float32 weights: torch._grouped_mm (the fused experts) reads its group offsets on the host "
                "for float32, so the decode step runs eagerly"
            )

    def _drop_graphs(self) -> None:
        """Forget every captured graph, and capture the next ones into a new private memory pool: the
        caching allocator refuses to share a pool whose graphs are all gone while it still holds blocks
        (its `use_count > 0` assertion at capture_begin), which a tensor made during a capture and kept
        by the model can cause."""
        self._buffers.clear()
        self._token_buffers.clear()
        if self.mode == "capture":
            self._pool = torch.cuda.graph_pool_handle()

    def take_captures(self) -> tuple[int, float]:
        """Graphs captured and the seconds that took since the last call (`StepStats`), then zero."""
        taken = (self.captures, self.capture_seconds)
        self.captures, self.capture_seconds = 0, 0.0
        return taken

    def _pool_sizes(self) -> tuple[int, ...]:
        return tuple(pool.num_blocks for pool in self.cache.pools)

    def token_limit(self) -> int:
        """Tokens a step with prefill tokens may have to be replayed (0: none is; `Scheduler.flat_tokens`).
        In the batch-invariant mode (bitwise on-policy RL) none is: its chunks keep the attention whose rows
        the GPU tests check against the learner bit for bit."""
        if not self.enabled or self.token_failure is not None or batch_invariant.active():
            return 0
        return self.max_tokens

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        layout: StepLayout,
        sampling: Sampling | None = None,
        prefill: bool = False,
    ) -> GraphStep | None:
        """The step's result, or None where it is not replayed: a step of other than one query per row in
        one attention group, a decode step of more rows than `max_batch`, a step with prefill tokens
        (`prefill`, laid out flat) of more than `max_tokens`, graphs off: the caller runs it eagerly.
        `sampling` is honoured where the graphs have a `head` (else `drawn` is None and the caller samples);
        `drawn` holds its rows' draws in order."""
        if not self.enabled or len(layout.groups) != 1 or layout.groups[0].token_index.shape[1] != 1:
            return None
        group = layout.groups[0]
        rows = group.token_index.shape[0]
        if rows > (self.token_limit() if prefill else self.max_batch):
            return None
        if self._pool_sizes() != self._sizes:  # a pool grew: its storage moved, the graphs are stale
            self._drop_graphs()
            self._sizes = self._pool_sizes()
        if self.head is None:
            sampling = None
        widths = tuple(_bucket(t.shape[1]) for t in group.tables)
        sampling_key = None if sampling is None else sampling.key()
        samplers = None
        key: tuple = (_bucket(rows), widths, sampling_key)
        store = self._buffers
        if prefill:  # sampling rows gathered from the step's rows: the most it can sample
            samplers = None if sampling is None else min(key[0], _bucket(self.max_samplers))
            store, key = self._token_buffers, (*key, samplers)
        buffers = store.get(key)
        if buffers is None:
            params = None if sampling is None else sampling.params
            buffers = _Buffers(key[0], widths, self.cache.block_size, self.device, params, samplers)
            if self.routing is not None:
                buffers.routing = self.routing.static(key[0], self.device)
            store[key] = buffers
        self._fill(buffers, input_ids, positions, layout, sampling)
        if self.mode == "padded":
            hidden, drawn = self._forward(buffers)
        else:
            if buffers.graph is None and not self._capture(buffers, prefill, key):
                return None
            assert buffers.graph is not None and buffers.hidden is not None
            buffers.graph.replay()
            hidden, drawn = buffers.hidden, buffers.drawn
        if self.routing is not None and buffers.routing is not None:
            self.routing.read_from(buffers.routing, rows)
        drawn_rows = rows if sampling is None or sampling.rows is None else len(sampling.rows)
        return GraphStep(hidden[:, :rows], None if drawn is None else drawn[:, :drawn_rows])

    def _fill(
        self,
        b: _Buffers,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        layout: StepLayout,
        sampling: Sampling | None,
    ) -> None:
        rows = input_ids.shape[1]
        group = layout.groups[0]
        for static, real in ((b.input_ids, input_ids), (b.positions, positions)):
            static[:, :rows].copy_(real)
            static[:, rows:].zero_()
        for i in range(len(b.tables)):
            b.slots[i][:rows].copy_(layout.slots[i])
            b.slots[i][rows:].zero_()  # padding writes slot 0: the null block
            b.q_positions[i][:rows].copy_(group.q_positions[i])
            b.q_positions[i][rows:].fill_(-1)
            width = group.tables[i].shape[1]
            b.tables[i][:rows, :width].copy_(group.tables[i])
            b.tables[i][:rows, width:].zero_()
            b.tables[i][rows:].zero_()
        if sampling is not None:
            n = len(sampling.seeds)
            picked = [] if b.sample_rows is None or sampling.rows is None else sampling.rows
            inputs = staged(sampling.seeds + sampling.counters + picked, self.device)
            b.seeds[:n].copy_(inputs[:n])
            b.counters[:n].copy_(inputs[n : 2 * n])
            b.seeds[n:].zero_()
            b.counters[n:].zero_()
            if b.sample_rows is not None:  # padding samples row 0, its draw dropped
                b.sample_rows[:n].copy_(inputs[2 * n :])
                b.sample_rows[n:].zero_()

    def _forward(self, b: _Buffers) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.cache.layout = b.layout
        routing, buffers = self.routing, b.routing
        recording = nullcontext() if routing is None or buffers is None else routing.writing_into(buffers)
        try:
            with recording:
                hidden = self.model.hidden_states(b.input_ids, position_ids=b.positions, cache=self.cache)
        finally:
            self.cache.layout = None
        if b.params is None or self.head is None:
            return hidden, None
        last = hidden[0] if b.sample_rows is None else hidden[0].index_select(0, b.sample_rows)
        tokens, logprobs = sample_from_logits(self.head(last), b.params, None, b.seeds, b.counters)
        return hidden, torch.stack([tokens.double(), logprobs.float().double()])

    def _capture(self, b: _Buffers, prefill: bool = False, key: tuple = ()) -> bool:
        """Capture the bucket `key`'s graph, after `WARMUP_FORWARDS` forwards on a side stream where the model
        has not had this bucket captured in the process (none where it has: a capture that then fails is
        retried after them); on failure turn graphs off (False): all of them, or with `prefill` those of
        steps with prefill tokens only. The capture forbids unsafe CUDA calls to this thread only
        ("thread_local"): the learner, or a thread receiving weights, may go on using the device while a
        rollout thread captures."""
        start = time.perf_counter()
        seen = _CAPTURED.setdefault(self.model, set())
        try:
            if (prefill, key) in seen:
                try:
                    self._record(b, 0)
                except RuntimeError as err:
                    log.info("capture without warm-up failed (%s); warming up and capturing again", err)
                    self._pool = torch.cuda.graph_pool_handle()  # whatever the failed capture left in it
                    self._record(b, WARMUP_FORWARDS)
            else:
                self._record(b, WARMUP_FORWARDS)
            seen.add((prefill, key))
            self.captures += 1
            return True
        except RuntimeError as err:  # an op that needs the host (e.g. the experts' loop backend)
            what = "a step with prefill tokens" if prefill else "the decode step"
            log.warning("CUDA graph capture of %s failed, running eagerly: %s", what, err, exc_info=True)
            if prefill:
                self.token_failure = f"{type(err).__name__}: {err}"
                self._token_buffers.clear()
                return False
            self.failure = f"{type(err).__name__}: {err}"
            self.enabled = False
            self._buffers.clear()
            self._token_buffers.clear()
            return False
        finally:
            self.capture_seconds += time.perf_counter() - start

    def _record(self, b: _Buffers, warmups: int) -> None:
        """`warmups` forwards on a side stream, then b's graph captured into the graphs' pool."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(warmups):
                self._forward(b)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self.warmups += warmups
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                b.hidden, b.drawn = self._forward(b)
        except RuntimeError as err:
            if "use_count" not in str(err):
                raise
            # the pool outlived its graphs (see _drop_graphs): this and later graphs get a new one
            self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                b.hidden, b.drawn = self._forward(b)
        b.graph = graph
        stream.synchronize()  # the warm-up forwards' time counted as the capture's
