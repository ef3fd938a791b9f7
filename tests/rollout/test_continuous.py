"""Continuous batching over the paged KV cache: the same tokens and log-probs as the static schedule and as
the learner, whatever the slots, chunks and block sizes; every block back on the free list afterwards."""

import math

import pytest
import torch
from helpers.embedded_engine import CONFIG, engine_of, perturbed_learner

from megatron_gptoss.config import ConfigError, EmbeddedEngineConfig
from megatron_gptoss.errors import EngineError
from megatron_gptoss.hf.convert import iter_hf_tensors
from megatron_gptoss.model import token_logprobs
from megatron_gptoss.rollout import EmbeddedEngine, SamplingParams
from megatron_gptoss.rollout.scheduler import FLAT_KEYS_PER_TOKEN, Chunk, Sequence

STOPS = [29, 83, 17]  # rows 0, 1, 2 stop after 5, 7, 8 tokens; the others reach max_new_tokens


@pytest.fixture(scope="module")
def learner():
    return perturbed_learner(3)


def prompts_of(lengths, seed=5) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 96, (n,), generator=gen).tolist() for n in lengths]


def learner_logprobs(model, prompt, tokens, temperature=1.0) -> torch.Tensor:
    ids = torch.tensor(prompt + tokens)[None]
    with torch.no_grad():
        hidden = model.hidden_states(ids[:, :-1])
        lp = token_logprobs(hidden, model.output_weight(), ids[:, 1:], temperature=temperature)[0]
    return lp[len(prompt) - 1 :]


def all_blocks_free(engine: EmbeddedEngine) -> bool:
    return all(free == capacity for free, capacity in engine.kv_blocks_free())


PARAMS = SamplingParams(temperature=0.9, max_new_tokens=14, stop_token_ids=STOPS, seed=21)
PROMPTS = prompts_of([3, 17, 5, 11, 1, 23, 9])


@pytest.fixture(scope="module")
def static_outs(learner):
    return engine_of(learner, schedule="static", max_batch_slots=8).generate(PROMPTS, PARAMS)


@pytest.mark.parametrize(
    "options",
    [
        dict(max_batch_slots=3, block_size=4, max_step_tokens=6),  # more prompts than slots, chunked prefill
        dict(max_batch_slots=2, block_size=1, max_step_tokens=2),
        dict(max_batch_slots=8, block_size=16, max_step_tokens=64),
        dict(max_batch_slots=3, block_size=4, max_step_tokens=5, kv_blocks=24),  # fixed cache: joins wait
        dict(schedule="static", max_batch_slots=3, block_size=4),  # static batches of 3
        dict(max_batch_slots=4, block_size=4, max_step_tokens=8, admit_batch=3),  # joins batched
        dict(max_batch_slots=4, block_size=4, max_step_tokens=8, admit_batch=4, admit_wait=2),  # or waited
        # steps with prefill tokens laid out flat, every token a row of the bucketed buffers (the graphs')
        dict(max_batch_slots=3, block_size=4, max_step_tokens=6, cuda_graphs="padded"),
        dict(
            max_batch_slots=4, block_size=2, max_step_tokens=9, cuda_graphs="padded", cuda_graph_max_tokens=6
        ),
    ],
)
def test_continuous_equals_static_and_learner(learner, static_outs, options):
    engine = engine_of(learner, **options)
    outs = engine.generate(PROMPTS, PARAMS)
    lengths = {len(o.token_ids) for o in outs}
    assert len(lengths) > 2 and {o.finish_reason for o in outs} == {"stop", "length"}  # rows end apart
    for out, ref, prompt in zip(outs, static_outs, PROMPTS):
        assert out.token_ids == ref.token_ids and out.finish_reason == ref.finish_reason
        lp = torch.tensor(out.logprobs)
        assert (lp - torch.tensor(ref.logprobs)).abs().max() <= 1e-6
        assert (lp - learner_logprobs(learner, prompt, out.token_ids, 0.9)).abs().max() <= 1e-6
    assert all_blocks_free(engine)
    assert engine.generate(PROMPTS[:2], PARAMS)[1].token_ids == outs[1].token_ids  # the cache is reused


def test_a_row_samples_the_same_alone_or_in_any_batch(learner, static_outs):
    engine = engine_of(learner, max_batch_slots=2, block_size=4, max_step_tokens=4)
    for row in (0, 3, 6):
        alone = SamplingParams(**{**PARAMS.__dict__, "seed": PARAMS.seed + row})
        assert engine.generate([PROMPTS[row]], alone)[0].token_ids == static_outs[row].token_ids
    shuffled = engine.generate(PROMPTS[::-1], SamplingParams(**{**PARAMS.__dict__, "seed": None}))
    assert len(shuffled) == len(PROMPTS)  # unseeded: runs, row order kept (values depend on the generator)
    assert all_blocks_free(engine)


def test_per_row_budgets_static_equals_continuous(learner, static_outs):
    budgets = [2, 14, 9, 1, 5, 12, 3]  # a static batch's short rows keep computing past their budget
    runs = [
        engine_of(learner, **options).generate(PROMPTS, PARAMS, max_new_tokens=budgets)
        for options in (dict(schedule="static", max_batch_slots=4, block_size=4), dict(max_batch_slots=3))
    ]
    for static, continuous, ref, budget in zip(*runs, static_outs, budgets):
        assert static.token_ids == continuous.token_ids == ref.token_ids[:budget]
        assert (torch.tensor(static.logprobs) - torch.tensor(continuous.logprobs)).abs().max() <= 1e-6
    with pytest.raises(ValueError, match="budget"):
        engine_of(learner).generate(PROMPTS, PARAMS, max_new_tokens=[1])


class AdmissionLog(EmbeddedEngine):
    """Records, for every step that admits waiting sequences beside running rows, (free slots, waiting,
    admitted, steps in a row that began with a free slot and a waiting sequence), and counts the steps that
    ran a plan built ahead."""

    def _step(self, ahead: bool = True):
        scheduler = self._scheduler
        before = list(scheduler.running) if scheduler is not None else []
        waiting = list(scheduler.waiting) if scheduler is not None else []
        free = self.options.max_batch_slots - len(before)
        self.streak = self.streak + 1 if free > 0 and waiting else 0
        built = self._ahead or (self._inflight.plan if self._inflight is not None else None)
        plan = super()._step(ahead)
        self.ahead_steps += int(built is not None and plan is built)
        joined = [c.seq for c in plan.chunks if c.seq in waiting]
        if joined and before:
            self.joins.append((free, len(waiting), len(joined), self.streak))
        return plan


def admission_run(learner, budgets, **options):
    engine = AdmissionLog(CONFIG, seed=0, options=EmbeddedEngineConfig(**options))
    engine.update_weights(iter_hf_tensors(learner, CONFIG))
    engine.joins, engine.ahead_steps, engine.streak = [], 0, 0
    prompts = prompts_of([4 + i % 5 for i in range(len(budgets))], seed=9)
    outs = engine.generate(prompts, SamplingParams(temperature=0.9, seed=4), max_new_tokens=budgets)
    assert all_blocks_free(engine)
    return engine, outs


def test_waiting_sequences_join_together_with_the_same_tokens(learner):
    """admit_batch k: while rows decode, waiting prompts join only once k slots are free (or as many as
    wait) or a slot has stood free admit_wait steps; every row samples what it samples joining at once, in
    fewer steps that prefill; the decode steps between run plans built ahead (padded graphs: the CPU's)."""
    budgets = [3, 5, 6, 8, 9, 11, 12, 14, 4, 7, 2, 9, 5, 3]  # rows end one or two steps apart
    common = dict(max_batch_slots=6, block_size=4, max_step_tokens=32, cuda_graphs="padded")
    eager, ref = admission_run(learner, budgets, admit_batch=1, **common)
    batched, outs = admission_run(learner, budgets, admit_batch=4, admit_wait=100, **common)
    waited, outs_waited = admission_run(learner, budgets, admit_batch=5, admit_wait=2, **common)
    for out, one, two in zip(ref, outs, outs_waited):
        assert out.token_ids == one.token_ids == two.token_ids
        assert (torch.tensor(out.logprobs) - torch.tensor(one.logprobs)).abs().max() <= 1e-6
        assert (torch.tensor(out.logprobs) - torch.tensor(two.logprobs)).abs().max() <= 1e-6
    assert all(free >= min(4, waiting) for free, waiting, _, _ in batched.joins)
    assert all(free >= min(5, waiting) or streak > 2 for free, waiting, _, streak in waited.joins)
    assert any(free < min(5, waiting) for free, waiting, _, _ in waited.joins)  # the wait admitted some
    assert len(batched.joins) < len(eager.joins)
    assert max(joined for _, _, joined, _ in batched.joins) > 1
    assert batched.ahead_steps > eager.ahead_steps  # waiting prompts not yet due keep the plan ahead


def test_sliding_window_layers_hold_only_their_window(learner):
    bs = 4
    engine = engine_of(learner, max_batch_slots=1, block_size=bs, max_step_tokens=4)
    sid = engine.open_session(prompts_of([30])[0], SamplingParams(max_new_tokens=10), seed=1)
    engine.step_sessions()
    (full_free, full_cap), (slide_free, slide_cap) = engine.kv_blocks_free()  # layer 0 sliding in tiny
    window_pool = next(p for p in engine._cache.pools if p.window is not None)
    full_pool = next(p for p in engine._cache.pools if p.window is None)
    held_full = full_pool.capacity - len(full_pool.free)
    held_window = window_pool.capacity - len(window_pool.free)
    assert held_full == math.ceil(39 / bs)  # 30 + 9 computed tokens (the last sample is not fed yet)
    assert held_window <= math.ceil((CONFIG.sliding_window - 1 + 1) / bs) + 1 < held_full
    engine.close_session(sid)
    assert all_blocks_free(engine)


def test_sliding_window_pools_start_at_the_prompts_chunks_and_grow_for_longer_ones(learner):
    """A growable cache (kv_blocks 0) gives each sliding-window pool what its rows' windows hold with the
    prompts' longest first chunk, not a whole step's chunk (`max_step_tokens` 64 here would ask as much as
    the full pools); two longer prompts joining later grow it. The generations equal those over a fixed
    cache sized for any chunk, and every block comes back."""
    bs, window = 4, CONFIG.sliding_window
    opts = dict(max_batch_slots=6, block_size=bs, max_step_tokens=64)
    short, long = prompts_of([3, 5, 2, 4], seed=9), prompts_of([30, 26], seed=10)
    params = SamplingParams(temperature=0.9, max_new_tokens=12, seed=5)
    outs, capacities = [], []
    for engine in (engine_of(learner, **opts), engine_of(learner, kv_blocks=200, **opts)):
        first = engine.start(short, params)
        pools = engine._cache.pools
        capacities.append([(p.window, p.capacity) for p in pools])
        engine.advance(3)
        later = engine.start(long, params)
        outs.append(engine.finish(first + later))
        capacities[-1] += [(p.window, p.capacity) for p in pools]
        assert all_blocks_free(engine)
    (grown, fixed) = capacities
    full_at_start = next(cap for w, cap in grown[:2] if w is None)
    window_at_start = next(cap for w, cap in grown[:2] if w is not None)
    assert full_at_start == 4 * math.ceil((5 + 12) / bs)
    assert window_at_start == 4 * (math.ceil((window - 1 + 5) / bs) + 1) < full_at_start
    assert next(cap for w, cap in grown[2:] if w is not None) > window_at_start  # the long prompts grew it
    whole_step = 6 * (math.ceil((window - 1 + 64) / bs) + 1)  # max_batch_slots rows of any chunk
    assert sorted(fixed, key=str) == sorted([(None, 199), (window, whole_step)] * 2, key=str)
    for ours, ref in zip(*outs):
        assert ours.token_ids == ref.token_ids and len(ours.token_ids) == 12
        assert (torch.tensor(ours.logprobs) - torch.tensor(ref.logprobs)).abs().max() <= 1e-6


def test_too_small_a_fixed_cache_is_named():
    engine = EmbeddedEngine(CONFIG, options=EmbeddedEngineConfig(block_size=4, kv_blocks=3))
    with pytest.raises(EngineError, match="kv_blocks"):
        engine.generate([[1] * 10], SamplingParams(max_new_tokens=8))


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("schedule", "dynamic", "schedule"),
        ("block_size", 0, "block_size"),
        ("max_step_tokens", 2, "max_step_tokens"),
        ("kv_blocks", -1, "kv_blocks"),
        ("cuda_graphs", "always", "cuda_graphs"),
        ("cuda_graph_max_batch", 0, "cuda_graph_max_batch"),
        ("cuda_graph_max_tokens", -1, "cuda_graph_max_tokens"),
        ("admit_batch", -1, "admit_batch"),
        ("admit_wait", -2, "admit_wait"),
    ],
)
def test_bad_engine_options_are_named(field, value, match):
    with pytest.raises(ConfigError, match=match):
        EmbeddedEngineConfig(max_batch_slots=4, **{field: value}).validate()


class FlatLog(EmbeddedEngine):
    """Records each step's (tokens, whether it prefilled, whether its layout was flat)."""

    def _step(self, ahead: bool = True):
        plan = super()._step(ahead)
        group = plan.layout.groups[0]
        flat = len(plan.layout.groups) == 1 and group.token_index.shape[1] == 1
        self.log.append((plan.input_ids.shape[1], any(c.count > 1 for c in plan.chunks), flat))
        return plan


def test_steps_with_prefill_tokens_laid_out_flat(learner):
    """With bucketed buffers, a step with prefill tokens of at most cuda_graph_max_tokens tokens is laid out
    as a decode step of that many rows (every token a row, its chunk's block tables), the larger ones in
    chunks; a long prompt's chunks, whose tokens see more than FLAT_KEYS_PER_TOKEN keys on average, stay
    in chunks. Every layout gives the tokens and log-probs of the eager steps."""
    prompts = prompts_of([3, 17, 5, 11, 1, 23, 9])
    common = dict(max_batch_slots=4, block_size=4, max_step_tokens=12)
    runs = {}
    for name, extra in [("eager", dict(cuda_graphs="off")), ("flat", dict(cuda_graphs="padded")),
                        ("some", dict(cuda_graphs="padded", cuda_graph_max_tokens=6))]:  # fmt: skip
        engine = FlatLog(CONFIG, seed=0, options=EmbeddedEngineConfig(**common, **extra))
        engine.update_weights(iter_hf_tensors(learner, CONFIG))
        engine.log = []
        runs[name] = (engine, engine.generate(prompts, PARAMS))
        assert all_blocks_free(engine)
    prefilled = {name: [(n, flat) for n, p, flat in e.log if p] for name, (e, _) in runs.items()}
    assert prefilled["eager"] and not any(flat for _, flat in prefilled["eager"])
    assert all(flat for _, flat in prefilled["flat"])
    assert {flat for _, flat in prefilled["some"]} == {True, False}
    assert all(flat == (n <= 6) for n, flat in prefilled["some"])
    assert runs["flat"][0]._graphs._token_buffers  # the flat steps ran in the bucketed buffers
    for name in ("flat", "some"):
        for out, ref in zip(runs[name][1], runs["eager"][1]):
            assert out.token_ids == ref.token_ids
            assert (torch.tensor(out.logprobs) - torch.tensor(ref.logprobs)).abs().max() <= 1e-6
    # a chunk whose tokens see more keys than the budget on average stays in chunks
    sched, budget = runs["flat"][0]._scheduler, FLAT_KEYS_PER_TOKEN
    long = Sequence(0, [1] * (3 * budget), PARAMS, seed=1, counter_base=0, budget=1)
    assert not sched._flat([Chunk(long, 2 * budget, 8, 0)])
    assert sched._flat([Chunk(long, 0, 8, 0)])
