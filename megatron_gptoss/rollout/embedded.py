"""The embedded rollout engine: our own model over a paged KV cache, fed weights by HF names.

    generate(prompts) / open_session(prompt)
        -> Scheduler (rollout/scheduler.py): waiting -> running (max_batch_slots) -> out
        -> one step: the running sequences' new tokens packed into [1, N] (decode rows one token each,
           prefill chunks in the rest of max_step_tokens) -> model forward over the PagedKVCache
        -> the last hidden state of every sequence whose tokens are all computed -> fp32 logits ->
           tempered log-softmax -> top-k / top-p -> sample (seeded per row, or the engine's generator)
        -> a row stops on a stop token or at its budget; a generation frees its blocks, a session pauses

`EmbeddedEngineConfig.schedule` picks continuous batching (rows leave and join within one call, chunked
prefill mixed with decode) or the static schedule (batches of prompts prefilled whole, decoded until the
batch's last row stops); both run the same step and give the same tokens and log-probs for a seeded request.

Partial rollouts: `start` / `advance` / `finish` keep rows in flight across `update_weights`; each sampled
token records `policy_version`, and `recompute_in_flight` has the rows prefill their prefix again.

Seeded sampling: row i of a `generate` request samples its response token t from counter t of the stream
seed + i (`rollout.sampling`), whatever rows share its steps. A session's token at sequence position p
(prompt included) comes from counter p of the session's seed (`engine_api.protocol.SessionEngine`).

The model and its cache belong to the engine; `update_weights` copies incoming tensors into the engine's own
parameters, so the learner's memory is never shared with it. `parallel_embedded` runs the same steps tensor-
and expert-parallel over several ranks (it overrides `_kv_heads`, `_logits`, `_block_any` and
`_check_request`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from megatron_gptoss.config import ModelConfig
from megatron_gptoss.config.engine import EmbeddedEngineConfig
from megatron_gptoss.config.memory import pool_blocks
from megatron_gptoss.engine_api.protocol import Generation, SamplingParams, SessionTurn, row_budget
from megatron_gptoss.errors import EngineError
from megatron_gptoss.hf.convert import load_hf_tensors
from megatron_gptoss.model import GPTOSSModel
from megatron_gptoss.model.logprobs import fp32_logits
from megatron_gptoss.model.paged_kv_cache import PagedKVCache
from megatron_gptoss.ops import moe_decode
from megatron_gptoss.rollout.decode_graphs import DecodeGraphs, GraphStep, Head, Sampling
from megatron_gptoss.rollout.memory import EngineMemory
from megatron_gptoss.rollout.routing import RoutingRecorder
from megatron_gptoss.rollout.sampling import sample_from_logits
from megatron_gptoss.rollout.scheduler import Scheduler, Sequence, StepPlan, staged


class _TokensBack:
    """A step's drawn tokens and log-probs ([2, rows] float64 on the device), copied to the host as soon as
    the step is enqueued (pinned memory, non-blocking on CUDA), so that the step after it may reuse the
    graph's buffers; `read` waits for that copy only."""

    def __init__(self, drawn: torch.Tensor):
        if drawn.is_cuda:
            self.host = torch.empty(drawn.shape, dtype=drawn.dtype, pin_memory=True)
            self.host.copy_(drawn, non_blocking=True)
            self.done: torch.cuda.Event | None = torch.cuda.Event()
            self.done.record()
        else:
            self.host, self.done = drawn.clone(), None

    def read(self) -> tuple[list[int], list[float]]:
        if self.done is not None:
            self.done.synchronize()
        return [int(t) for t in self.host[0].tolist()], self.host[1].tolist()


@dataclass
class _InFlight:
    """A decode step launched ahead: its plan, its result on the device, its tokens on their way back."""

    plan: StepPlan
    step: GraphStep
    tokens: _TokensBack


@dataclass
class StepStats:
    """What the engine's steps did since the last `EmbeddedEngine.take_stats`: every step's wall time runs
    from its plan to its sampled tokens on the host (the step's one host sync), so the seconds add up to the
    time spent stepping. A decode step computes one token of each row; any other step prefills too."""

    steps: int = 0
    seconds: float = 0.0
    decode_steps: int = 0
    decode_seconds: float = 0.0
    decode_rows: int = 0
    graph_steps: int = 0  # decode steps replayed from a captured graph
    prefill_graph_steps: int = 0  # steps that prefilled, replayed from a captured graph (laid out flat)
    prefill_tokens: int = 0  # tokens of multi-token chunks (prompts, resumed prefixes)
    captures: int = 0  # graphs captured (each bucket's first step, again after sleep or a grown cache)
    capture_seconds: float = 0.0  # of the steps' seconds, those spent capturing

    def record(self, plan: StepPlan, seconds: float, graph: bool, captures: int, capture_s: float) -> None:
        self.steps += 1
        self.seconds += seconds
        self.captures += captures
        self.capture_seconds += capture_s
        if all(c.count == 1 for c in plan.chunks):
            self.decode_steps += 1
            self.decode_seconds += seconds
            self.decode_rows += len(plan.chunks)
            self.graph_steps += int(graph)
        else:
            self.prefill_tokens += sum(c.count for c in plan.chunks if c.count > 1)
            self.prefill_graph_steps += int(graph)

    def metrics(self) -> dict[str, float]:
        """`engine/*` (counts) and `time/engine_*` (seconds): steps, seconds, the mean decode step (ms) and
        its rows, the share of decode steps replayed from graphs, the seconds of steps that prefilled, their
        count, prefill tokens and share replayed from graphs, the graphs captured and the seconds that took
        (inside the steps')."""
        if not self.steps:
            return {}
        decode = max(self.decode_steps, 1)
        return {
            "engine/steps": float(self.steps),
            "time/engine_step_s": self.seconds,
            "engine/decode_steps": float(self.decode_steps),
            "time/engine_decode_step_ms": 1e3 * self.decode_seconds / decode,
            "engine/decode_rows_mean": self.decode_rows / decode,
            "engine/graph_frac": self.graph_steps / decode,
            "time/engine_prefill_s": self.seconds - self.decode_seconds,
            "engine/prefill_steps": float(self.steps - self.decode_steps),
            "engine/prefill_tokens": float(self.prefill_tokens),
            "engine/prefill_graph_frac": self.prefill_graph_steps / max(self.steps - self.decode_steps, 1),
            "engine/graph_captures": float(self.captures),
            "time/engine_capture_s": self.capture_seconds,
        }


class EmbeddedEngine:
    """Generation with our GPT-OSS. `dtype`/`device` are the engine's own; `options` its scheduler and
    KV cache (defaults: `EmbeddedEngineConfig()`)."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device="cpu",
        seed: int = 0,
        options: EmbeddedEngineConfig | None = None,
    ):
        self.config = config
        self.dtype, self.device = dtype, torch.device(device)
        self.model = GPTOSSModel(config, dtype=dtype, device=self.device).eval()
        self._setup(seed, options)

    def _setup(self, seed: int, options: EmbeddedEngineConfig | None) -> None:
        """The state every engine variant shares (the model is built by the caller)."""
        self.options = EmbeddedEngineConfig() if options is None else options
        self.options.validate()
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.asleep = False
        self.weight_version = 0
        # the policy version recorded with every sampled token (set by the trainer after each sync)
        self.policy_version = 0
        self.memory = EngineMemory(self.model, self.device)
        self.routing = RoutingRecorder(self.model, self.config) if self.options.record_routing else None
        self._cache: PagedKVCache | None = None
        self._scheduler: Scheduler | None = None
        self._graphs: DecodeGraphs | None = None
        # the next decode step's plan, built while the last step ran (`_step`)
        self._ahead: StepPlan | None = None
        # a decode step launched ahead (`EmbeddedConfig.decode_ahead`) whose tokens the next step reads
        self._inflight: _InFlight | None = None
        self._sessions: dict[int, Sequence] = {}
        self._next_session = 0
        self._turns: list[SessionTurn] = []
        self.stats = StepStats()

    # ----------------------------------------------------------------------------------------------
    def update_weights(self, tensors: Iterable[tuple[str, torch.Tensor]], strict: bool = True) -> None:
        """Copy (HF name, tensor) pairs into the engine's parameters. With `strict`, every parameter
        must arrive (a full sync); otherwise a subset may be sent."""
        self._check_awake("update_weights")
        load_hf_tensors(self.model, self.config, tensors, strict=strict)
        self.memory.weights_loaded()
        self.weight_version += 1

    def sleep(self, level: int = 1) -> dict[str, int]:
        """Free the KV cache and the weights' device memory: level 1 moves the weights to the host, level 2
        discards them (the next `update_weights` after `wake_up` must send every parameter). Returns the
        bytes released (`EngineMemory.sleep`). Refused while sessions are open (their caches would be
        lost)."""
        if self._sessions:
            raise EngineError(f"sleep with {len(self._sessions)} open session(s): close them first")
        released = self.memory.sleep(level, self._release_cache)
        self.asleep = True
        return released

    def _release_cache(self) -> int:
        """Drop the KV cache (allocated again by the next request); returns its bytes."""
        kv_bytes = self._cache.storage_bytes() if self._cache is not None else 0
        if self._cache is not None:  # freed now, whatever else still refers to the cache
            self._cache.drop_storage()
        self._cache, self._scheduler, self._graphs, self._ahead = None, None, None, None
        self._inflight = None
        return kv_bytes

    def wake_up(self) -> dict[str, int]:
        """Take the weights' device memory back (the KV cache is allocated again by the next request)."""
        taken = self.memory.wake()
        self.asleep = False
        return taken

    def reconfigure(self, options: EmbeddedEngineConfig) -> None:
        """Replace the scheduler and cache options (the KV cache is freed; no session may be open).
        `record_routing` keeps the value the engine was built with."""
        if self._sessions:
            raise EngineError(f"reconfigure with {len(self._sessions)} open session(s): close them first")
        options.validate()
        self._release_cache()
        self.options = options

    def shutdown(self) -> None:
        self._cache, self._scheduler = None, None
        del self.model

    # ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], params: SamplingParams, max_new_tokens: list[int] | None = None
    ) -> list[Generation]:
        """One response per prompt. `max_new_tokens` (this engine's extension): a budget per row in place
        of `params.max_new_tokens`."""
        return self.finish(self.start(prompts, params, max_new_tokens))

    def start(
        self, prompts: list[list[int]], params: SamplingParams, max_new_tokens: list[int] | None = None
    ) -> list[Sequence]:
        """Queue one row per prompt (row i samples from the stream `params.seed + i`, its budget by
        `protocol.row_budget`) and return the rows without stepping: they advance in later `advance` /
        `finish` calls alongside every other row, across weight updates (partial rollouts). Arguments as
        `generate`'s."""
        self._check_awake("generate")
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if max_new_tokens is None:
            budgets = [row_budget(params, row) for row in range(len(prompts))]
        else:
            budgets = list(max_new_tokens)
        if len(budgets) != len(prompts) or min(budgets) < 1:
            raise ValueError(
                f"max_new_tokens needs one budget >= 1 per prompt ({len(prompts)}), got {budgets}"
            )
        self._check_request(prompts, params)
        rows = min(len(prompts), self.options.max_batch_slots)
        scheduler = self._ensure_scheduler(rows, prompts, max(budgets))
        seqs = [
            Sequence(
                sid=-1,
                tokens=list(prompt),
                params=params,
                seed=None if params.seed is None else params.seed + row,
                counter_base=len(prompt),
                budget=budget,
            )
            for row, (prompt, budget) in enumerate(zip(prompts, budgets))
        ]
        for seq in seqs:
            scheduler.add(seq)
        return seqs

    @torch.no_grad()
    def advance(self, steps: int) -> None:
        """Run at most `steps` engine steps over the rows in flight (fewer once no rank of the lockstep
        block has any left)."""
        self._check_awake("generate")
        for i in range(steps):
            if not self._block_any(self._scheduler is not None and self._scheduler.has_work()):
                break
            self._step(ahead=i < steps - 1)
        self._drain()

    @torch.no_grad()
    def finish(self, seqs: list[Sequence]) -> list[Generation]:
        """Step until every row of `seqs` (from `start`) has stopped; their generations, in order. Other
        rows in flight advance alongside."""
        self._check_awake("generate")
        while self._block_any(any(not s.left for s in seqs)):
            self._step()
        self._drain()
        return [
            Generation(
                prompt_ids=seq.tokens[: seq.counter_base],
                token_ids=seq.out_tokens,
                logprobs=seq.out_logprobs,
                finish_reason=seq.finish_reason or "length",
                routing=self._routing_of(seq, seq.counter_base + len(seq.out_tokens) - 1),
                versions=seq.out_versions,
            )
            for seq in seqs
        ]

    def recompute_in_flight(self) -> int:
        """`rollout.partial_kv: recompute`: every generation row in flight drops its KV cache, to be
        prefilled again under the weights of now (call after `update_weights`); the rows sent back."""
        self._drain()
        self._ahead = None
        return self._scheduler.recompute() if self._scheduler is not None else 0

    @torch.no_grad()
    def sequence_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """log p(token_t | tokens_<t) at temperature 1 for t = 1..n-1 of each sequence: one forward over the
        sequences, right-padded into one batch (causal: padding never reaches a real position)."""
        if not sequences or any(len(s) < 2 for s in sequences):
            raise ValueError("every sequence needs at least two tokens")
        self._check_request(sequences, None)
        longest = max(len(s) for s in sequences)
        ids = torch.zeros(len(sequences), longest, dtype=torch.long, device=self.device)
        for row, seq in enumerate(sequences):
            ids[row, : len(seq)] = torch.tensor(seq, device=self.device)
        hidden = self.model.hidden_states(ids[:, :-1])
        logprobs, _ = self.model.token_logprobs(hidden, ids[:, 1:])
        return [logprobs[row, : len(seq) - 1].tolist() for row, seq in enumerate(sequences)]

    # -------------------------------------------------------------------- sessions (SessionEngine)
    def open_session(self, prompt_ids: list[int], params: SamplingParams, seed: int | None = None) -> int:
        """A trajectory that keeps its KV cache across turns; it starts at the next `step_sessions`."""
        self._check_awake("open_session")
        if self.options.schedule != "continuous":
            raise EngineError("sessions need embedded.schedule='continuous'")
        if not prompt_ids:
            raise ValueError("a session's prompt needs at least one token")
        scheduler = self._ensure_scheduler(self.options.max_batch_slots, [prompt_ids], params.max_new_tokens)
        sid = self._next_session
        self._next_session += 1
        seq = Sequence(sid, list(prompt_ids), params, seed, counter_base=0, budget=params.max_new_tokens)
        self._sessions[sid] = seq
        scheduler.add(seq)
        return sid

    @torch.no_grad()
    def step_sessions(self) -> list[SessionTurn]:
        """Run every open, un-paused session until at least one pauses; the turns of those that paused."""
        self._check_awake("step_sessions")
        while self._block_any(not self._turns and self._scheduler is not None and self._scheduler.has_work()):
            self._step()
        self._drain()
        turns, self._turns = self._turns, []
        return turns

    def extend_session(self, sid: int, token_ids: list[int], max_new_tokens: int) -> None:
        """Append tokens written outside the model (prefilled next step) and resume for max_new_tokens."""
        seq = self._session(sid)
        if seq.finish_reason is None:
            raise EngineError(f"session {sid} is not paused: step_sessions until it returns a turn")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        seq.tokens.extend(int(t) for t in token_ids)
        seq.budget, seq.finish_reason = max_new_tokens, None
        seq.out_tokens, seq.out_logprobs, seq.routing = [], [], []
        assert self._scheduler is not None
        self._scheduler.add(seq)

    def close_session(self, sid: int) -> None:
        """Free the session's KV blocks; its unreturned turn, if any, is dropped."""
        seq = self._session(sid)
        if self._scheduler is not None:
            self._scheduler.discard(seq)
        del self._sessions[sid]
        self._turns = [t for t in self._turns if t.session_id != sid]

    def _session(self, sid: int) -> Sequence:
        if sid not in self._sessions:
            raise EngineError(f"no open session {sid}")
        return self._sessions[sid]

    # ------------------------------------------------------------------------------- one step
    def _step(self, ahead: bool = True) -> StepPlan:
        """One forward over the scheduler's packed tokens, then sampling and bookkeeping (one host sync).
        Returns the step's plan (its chunks say what was computed).

        A decode step replayed from a graph with its sampling inside lets the host build the next step's
        plan (`Scheduler.plan_ahead`) while the device computes. With `decode_ahead` (and `ahead`) that next
        step is launched before this one's tokens are read, its token ids the sampled ones on the device
        (`_launch_ahead`): the next call takes it as its step, its rows that stopped in between dropped.
        Otherwise the next step takes the plan where every row went on (no stop), with the sampled tokens
        written in, and plans afresh where not."""
        assert self._scheduler is not None and self._cache is not None
        scheduler = self._scheduler
        start = time.perf_counter()
        scheduler.flat_tokens = self._graphs.token_limit() if self._graphs is not None else 0
        inflight, self._inflight = self._inflight, None
        if inflight is not None:  # launched by the last step: its rows that stopped since are dropped
            plan, step, tokens_back = inflight.plan, inflight.step, inflight.tokens
            hidden = step.hidden
            running = {id(seq) for seq in scheduler.running}
            kept = [c for c in plan.chunks if id(c.seq) in running]
        else:
            plan = self._take_ahead() or scheduler.plan() or scheduler.idle_plan()
            with moe_decode.decode_scope():  # few rows per expert: the decode expert kernels (16-bit, CUDA)
                hidden, step = self._forward(plan)
            kept, tokens_back = plan.chunks, None
        all_kept = len(kept) == len(plan.chunks)
        if self.routing is not None:
            self.routing.collect(plan)
        scheduler.computed(plan, kept)
        if plan.samplers:
            if step is not None and step.drawn is not None:
                tokens_back = tokens_back or _TokensBack(step.drawn)
                next_plan = scheduler.plan_ahead() if all_kept else None
                if next_plan is not None and ahead and self.options.decode_ahead:
                    self._inflight = self._launch_ahead(plan, next_plan, step)
                    next_plan = None if self._inflight is not None else next_plan
                tokens, logprobs = tokens_back.read()  # the step's one host sync
            else:
                rows = torch.tensor([c.offset + c.count - 1 for c in plan.samplers], device=self.device)
                logits = self._logits(hidden[0].index_select(0, rows))
                tokens, logprobs = self._sample(logits, [c.seq for c in plan.samplers])
                next_plan = None
            live = None if all_kept else {id(c.seq) for c in kept}
            for chunk, token, logprob in zip(plan.samplers, tokens, logprobs):
                if live is None or id(chunk.seq) in live:
                    self._advance(chunk.seq, token, logprob)
            self._ahead = next_plan
        if scheduler.static and scheduler.running and all(s.ghost for s in scheduler.running):
            for seq in list(scheduler.running):  # the static batch's last row finished: free the batch
                scheduler.stop(seq, keep_blocks=False)
                seq.left = True
        if plan.chunks:
            graphs = self._graphs
            captured = graphs.take_captures() if graphs is not None else (0, 0.0)
            replayed = step is not None and graphs is not None and graphs.mode == "capture"
            self.stats.record(plan, time.perf_counter() - start, replayed, *captured)
        return plan

    def _launch_ahead(self, plan: StepPlan, next_plan: StepPlan, step: GraphStep) -> _InFlight | None:
        """Launch `next_plan` (built ahead of `plan`, whose decode step `step` is on the device) from its
        graph, its token ids the ones `step` sampled, copied on the device; None (nothing launched) where
        it cannot be: a routing record (read back each step), `plan` not a decode step of the same rows in
        the same order, no graph of the next step or no sampling inside it."""
        if self.routing is not None or self._graphs is None or step.drawn is None:
            return None
        rows = [c.seq for c in plan.samplers]
        if len(rows) != len(plan.chunks) or any(c.count != 1 for c in plan.chunks):
            return None
        if len(rows) != len(next_plan.chunks) or any(c.seq is not s for c, s in zip(next_plan.chunks, rows)):
            return None
        sampling = self._graph_sampling(next_plan, False, pending=1)
        if sampling is None:
            return None
        next_plan.input_ids.copy_(step.drawn[0].view(1, -1))  # float64 token ids, exact
        with moe_decode.decode_scope():
            launched = self._graphs.run(
                next_plan.input_ids, next_plan.positions, next_plan.layout, sampling, False
            )
        if launched is None or launched.drawn is None:
            return None
        return _InFlight(next_plan, launched, _TokensBack(launched.drawn))

    def _drain(self) -> None:
        """Take the step launched ahead, if any, without launching another: nothing is left on the device
        for a later call to read (before a weight update, a sleep, or the caller's next request)."""
        if self._inflight is not None:
            self._step(ahead=False)

    def take_stats(self) -> dict[str, float]:
        """The `engine/*` metrics of the steps since the last call (`StepStats`), then counted afresh."""
        stats, self.stats = self.stats, StepStats()
        return stats.metrics()

    def _forward(self, plan: StepPlan):
        """The step's hidden states, replayed from a decode graph (then also its `step`) or run eagerly."""
        assert self._cache is not None
        if self._graphs is not None and plan.chunks:
            prefill = any(c.count > 1 for c in plan.chunks)
            sampling = self._graph_sampling(plan, prefill)
            step = self._graphs.run(plan.input_ids, plan.positions, plan.layout, sampling, prefill)
            if step is not None:
                return step.hidden, step
        self._cache.layout = plan.layout
        try:
            return self.model.hidden_states(
                plan.input_ids, position_ids=plan.positions, cache=self._cache
            ), None
        finally:
            self._cache.layout = None

    def _take_ahead(self) -> StepPlan | None:
        """The plan built ahead during the last step, where it still holds: the same rows run, in the same
        order, each having sampled exactly its one token since (no waiting sequence due for admission); its
        token ids written."""
        plan, self._ahead = self._ahead, None
        scheduler = self._scheduler
        if plan is None or scheduler is None or scheduler.admission_due():
            return None
        chunks = plan.chunks
        if len(chunks) != len(scheduler.running) or any(
            c.seq is not s or len(s.tokens) != c.start + 1 for c, s in zip(chunks, scheduler.running)
        ):
            return None
        plan.input_ids.copy_(staged([c.seq.tokens[-1] for c in chunks], self.device).view(1, -1))
        return plan

    def _graph_sampling(self, plan: StepPlan, prefill: bool, pending: int = 0) -> Sampling | None:
        """Sampling inside the step's graph where every sampling row is seeded, with one temperature / top-k /
        top-p (the draws are those of `_sample`: one sampler, seeds, counters) and, in a decode step, every
        row samples; with `prefill` (a step laid out flat) the sampling chunks' last tokens. `pending`: tokens
        each row has sampled that its sequence does not hold yet (a step launched ahead: 1)."""
        if not plan.samplers or (not prefill and len(plan.samplers) != len(plan.chunks)):
            return None
        seqs = [c.seq for c in plan.samplers]
        first = seqs[0].params
        key = (first.temperature, first.top_k, first.top_p)
        if any(s.seed is None or (s.params.temperature, s.params.top_k, s.params.top_p) != key for s in seqs):
            return None
        seeds = [s.seed for s in seqs if s.seed is not None]
        rows = [c.offset + c.count - 1 for c in plan.samplers] if prefill else None
        counters = [len(s.tokens) + pending - s.counter_base for s in seqs]
        return Sampling(first, seeds, counters, rows)

    def _graph_head(self) -> Head | None:
        """The fp32 logits the decode graphs compute for sampling inside the graph (None: sampling stays out
        of the graphs)."""
        return self._logits

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[float]]:
        """One draw per row, rows grouped by their sampling parameters and seeding."""
        groups: dict[tuple[int, bool], list[int]] = {}
        for row, seq in enumerate(seqs):
            groups.setdefault((id(seq.params), seq.seed is not None), []).append(row)
        tokens = torch.empty(len(seqs), dtype=torch.long, device=self.device)
        logprobs = torch.empty(len(seqs), dtype=torch.float32, device=self.device)
        for (_, seeded), rows in groups.items():
            members = [seqs[r] for r in rows]
            seeds, counters = None, torch.zeros(len(rows), dtype=torch.long, device=self.device)
            if seeded:
                seeds = torch.tensor([s.seed for s in members], device=self.device)
                counters = torch.tensor([len(s.tokens) - s.counter_base for s in members], device=self.device)
            index = torch.tensor(rows, device=self.device)
            tok, lp = sample_from_logits(
                logits.index_select(0, index), members[0].params, self.generator, seeds, counters
            )
            tokens[index], logprobs[index] = tok, lp.float()
        drawn = torch.stack([tokens.double(), logprobs.double()]).cpu()  # one copy back to the host
        return [int(t) for t in drawn[0].tolist()], drawn[1].tolist()

    def _advance(self, seq: Sequence, token: int, logprob: float) -> None:
        """Record a sampled token; stop the row on a stop token or at its budget."""
        seq.tokens.append(token)
        if seq.ghost:
            return
        seq.out_tokens.append(token)
        seq.out_logprobs.append(logprob)
        seq.out_versions.append(self.policy_version)
        seq.budget -= 1
        if token in seq.params.stop_token_ids:
            seq.finish_reason = "stop"
        elif seq.budget == 0:
            seq.finish_reason = "length"
        else:
            return
        assert self._scheduler is not None
        if seq.sid >= 0:  # a session pauses with its blocks
            self._scheduler.stop(seq, keep_blocks=True)
            turn = SessionTurn(
                seq.sid,
                list(seq.out_tokens),
                list(seq.out_logprobs),
                seq.finish_reason,
                self._routing_of(seq, None),
            )
            self._turns.append(turn)
        elif self._scheduler.static:
            seq.ghost = True
        else:
            self._scheduler.stop(seq, keep_blocks=False)
            seq.left = True

    def _routing_of(self, seq: Sequence, tokens: int | None) -> torch.Tensor | None:
        if self.routing is None:
            return None
        return self.routing.of(seq, tokens)

    def _ensure_scheduler(self, rows: int, prompts: list[list[int]], most_new: int) -> Scheduler:
        """The cache and scheduler, created on first use: `kv_blocks` per full-attention pool (0: sized for
        `rows` of these prompts, grown between steps when short); a sliding-window pool, where that is less
        than the full pools', what its rows' windows hold at most with their first prefill chunk (a row's
        window quota, `Scheduler._quota`): with `kv_blocks`, `max_batch_slots` rows of any chunk of at most
        `max_step_tokens`; else `rows` of these prompts' longest chunk (grown, like a full pool, for a
        longer one later: 512 rows of 100-token prompts under the default 2,048-token steps hold 16 blocks a
        row instead of the 137 of a whole step's chunk)."""
        if self._scheduler is None:
            opts = self.options
            longest = max(len(p) for p in prompts)
            blocks_of = functools.partial(
                pool_blocks, rows, longest + most_new, longest, block_size=opts.block_size,
                max_step_tokens=opts.max_step_tokens, kv_blocks=opts.kv_blocks,
                max_batch_slots=opts.max_batch_slots, static=opts.schedule == "static",
            )  # fmt: skip
            blocks, window_blocks = blocks_of(None), blocks_of(self.config.sliding_window)
            self._cache = PagedKVCache(
                self.config,
                opts.block_size,
                max(blocks, 2),
                self.dtype,
                self.device,
                kv_heads=self._kv_heads(),
                window_blocks=max(window_blocks, 2),
            )
            self._scheduler = Scheduler(self._cache, self.options, self.options.kv_blocks == 0, self.device)
            mode = self._graph_mode()
            if mode is not None:
                self._graphs = DecodeGraphs(
                    self.model, self._cache, opts.cuda_graph_max_batch, mode, self._graph_head(),
                    self.routing, opts.cuda_graph_max_tokens, opts.max_batch_slots,
                )  # fmt: skip
        return self._scheduler

    def _graph_mode(self) -> str | None:
        """ "capture", "padded" or None (decode steps run eagerly): `cuda_graphs` resolved for this engine
        (a routing record comes out of the graphs' static buffers: `DecodeGraphs`)."""
        mode = self.options.cuda_graphs
        if mode == "padded":
            return mode
        if mode == "auto" and self.device.type == "cuda":
            return "capture"
        return None

    def kv_blocks_free(self) -> list[tuple[int, int]]:
        """(free, capacity) blocks of every layer group of the KV cache (none before the first request)."""
        if self._cache is None:
            return []
        return [(len(pool.free), pool.capacity) for pool in self._cache.pools]

    # ----------------------------------------------------------------------------------------------
    def _check_awake(self, what: str) -> None:
        if self.asleep:
            raise EngineError(f"{what} called while the engine sleeps; call wake_up() first")
        if what != "update_weights" and not self.memory.has_weights:
            raise EngineError(
                f"{what} called after sleep(level=2) and before update_weights sent the weights"
            )

    def _check_request(self, prompts: list[list[int]], params: SamplingParams | None) -> None:
        """Where several ranks serve one request together, that they were given the same (a no-op here)."""

    def _kv_heads(self) -> int:
        """KV heads this instance caches."""
        return self.config.num_query_groups

    def _logits(self, last: torch.Tensor) -> torch.Tensor:
        """Last hidden states [B, H] -> fp32 logits [B, vocab_size] of the real vocabulary: the learner's
        GEMM (`model.logprobs.fp32_logits`: half-precision tensor cores with fp32 accumulation and output on
        a GPU, fp32 elsewhere)."""
        return fp32_logits(last, self.model.output_weight())

    def _block_any(self, flag: bool) -> bool:
        """Whether any rank stepping in lockstep with this one has `flag` set (this rank alone here)."""
        return flag
