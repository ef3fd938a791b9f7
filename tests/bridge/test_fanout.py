"""Fan-out into a tensor- and expert-parallel embedded engine colocated with the learner, on gloo: learners
in tp2, ep2, pp2 (2 ranks) and tp2 x ep2 x pp2 (8 ranks) sync into engines of other layouts (tp2, ep2, tp1
replicas; tp2 x ep2, tp2 x ep4, tp1 replicas on 8 ranks). After a sync every engine rank's parameters are
the single-process model's narrowed to its shard, bit for bit; its log-probs of fixed sequences, greedy and
seeded sampled generations equal the single-process `EmbeddedEngine`'s (tp groups of one lockstep block
generate from different prompts and stop at different steps); a k/v-swapped stream gives other log-probs."""

import ctypes
from pathlib import Path

import pytest
import torch
from helpers.bridge_layouts import LAYOUTS, _rss, _stages
from helpers.harness import pool
from helpers.vllm_checks import CORRUPTIONS, max_delta

from megatron_gptoss.bridge.fanout import FanoutExporter
from megatron_gptoss.bridge.plan import EngineLayout
from megatron_gptoss.config import ParallelConfig, gpt_oss_tiny
from megatron_gptoss.engine_api.protocol import expert_slice_name
from megatron_gptoss.errors import CheckpointError
from megatron_gptoss.hf.convert import iter_hf_tensors
from megatron_gptoss.hf.names import hf_shapes, match_ours, our_names
from megatron_gptoss.model import build_model
from megatron_gptoss.parallel.dims import ParallelDims
from megatron_gptoss.parallel.sharding import get_shard, local_shard
from megatron_gptoss.rollout import EmbeddedEngine, SamplingParams
from megatron_gptoss.rollout.parallel_embedded import ParallelEmbeddedEngine

CONFIG = gpt_oss_tiny(vocab_size=90, num_experts=8)  # 90 rows: padding differs between tp1 and tp2
BUCKET = 8 * 1024  # several buckets per pass; one expert's gate_up_proj is 8 KiB
TOLERANCE = 1e-5
TIMEOUT = 180.0  # seconds per pool call: a rank that fails leaves the others waiting in a collective
VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")
ENGINES = {
    2: {"tp2": dict(tp=2), "ep2": dict(ep=2), "tp1": dict()},
    8: {"tp2xep2": dict(tp=2, ep=2), "tp2xep4": dict(tp=2, ep=4), "tp1": dict()},
}
MIXED_BLOCK = {2: "ep2", 8: "tp2xep4"}
PROMPT_SETS = ([[5, 17, 3], [40, 2, 2, 9, 61, 7, 7, 30, 1], [11]], [[8, 8, 8, 8, 8], [70, 1]])
SEQUENCES = torch.randint(0, 90, (3, 20), generator=torch.Generator().manual_seed(9)).tolist()


def learner_state(seed: int) -> dict[str, torch.Tensor]:
    model = build_model(CONFIG, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
            if name in VOCAB_PARAMS:
                p[CONFIG.vocab_size :] = 0
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def share_bytes(ep: int) -> int:
    """What one engine rank of expert parallel `ep` needs: every dense HF tensor, 1/ep of the experts."""
    total = 0
    for name in our_names(CONFIG):
        size = 4 * sum(torch.Size(s).numel() for s in hf_shapes(match_ours(name), CONFIG))
        total += size // ep if ".mlp.experts." in name else size
    return total


def generations(outs) -> list[tuple[list[int], list[float], str]]:
    return [(o.token_ids, o.logprobs, o.finish_reason) for o in outs]


def sampling(stop: int) -> dict[str, SamplingParams]:
    return {
        "greedy": SamplingParams(top_k=1, max_new_tokens=12, stop_token_ids=[stop]),
        "sampled": SamplingParams(temperature=0.8, max_new_tokens=12, seed=5),
    }


def sync_engines_on_ranks(state, parallel, engines, params):
    """(Every rank) the learner's shards of `state`; for each engine layout: a fan-out sync, the bitwise
    check, log-probs and generations (prompt set by dp rank), then a k/v-swapped sync."""
    chunks, dims = _stages(CONFIG, state, parallel)
    out = {}
    for name, layout in engines.items():
        pcfg = ParallelConfig(
            tensor_model_parallel_size=layout.get("tp", 1), expert_model_parallel_size=layout.get("ep", 1)
        )
        edims = ParallelDims.build(pcfg, CONFIG)
        engine = ParallelEmbeddedEngine(CONFIG, edims, seed=0)
        target = EngineLayout(workers=dims.layout.world, ep=edims.ep, expert_slices=True)
        exporter = FanoutExporter(chunks, CONFIG, dims, target, BUCKET)
        learner_ptrs = {p.untyped_storage().data_ptr() for c in chunks for p in c.parameters()}
        received = list(exporter.pairs())
        assert not any(t.untyped_storage().data_ptr() in learner_ptrs for _, t in received)
        engine.update_weights(iter(received))
        padded = CONFIG.padded_vocab_size(edims.tp)
        wrong = [
            n
            for n, p in engine.model.named_parameters()
            if not torch.equal(p, local_shard(state[n], get_shard(p), edims, padded))
        ]
        prompts = PROMPT_SETS[edims.coord("dp") % 2]
        result = {
            "wrong_params": wrong,
            "received": sum(t.numel() * t.element_size() for _, t in received),
            "share": share_bytes(edims.ep),
            "logprobs": engine.sequence_logprobs(SEQUENCES),
            "prompt_set": edims.coord("dp") % 2,
            **{k: generations(engine.generate(prompts, sp)) for k, sp in params.items()},
            "one_row": generations(engine.generate(PROMPT_SETS[0][:1], params["greedy"])),  # a tp rank idles
        }
        engine.update_weights(CORRUPTIONS["k_v_swapped"](exporter.pairs()))
        result["k_v_swapped"] = engine.sequence_logprobs(SEQUENCES)
        out[name] = result
    return out


@pytest.fixture(scope="module")
def reference():
    """The single-process engine's results for each learner seed (computed lazily)."""
    cache: dict[int, dict] = {}

    def get(seed: int) -> dict:
        if seed not in cache:
            state = learner_state(seed)
            model = build_model(CONFIG, seed=0)
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(state[n])
            engine = EmbeddedEngine(CONFIG, seed=0)
            engine.update_weights(iter_hf_tensors(model, CONFIG))
            free = [engine.generate(p, SamplingParams(top_k=1, max_new_tokens=12)) for p in PROMPT_SETS]
            late = {t for g in free[1] for t in g.token_ids}
            # a stop token that set 0 samples and set 1 never does: one block stops rows at different steps
            stop = next(t for g in free[0] for t in g.token_ids[2:] if t not in late)
            params = sampling(stop)
            out = {"state": state, "params": params, "logprobs": engine.sequence_logprobs(SEQUENCES)}
            for k, sp in params.items():
                out[k] = [generations(engine.generate(prompts, sp)) for prompts in PROMPT_SETS]
            out["one_row"] = generations(engine.generate(PROMPT_SETS[0][:1], params["greedy"]))
            cache[seed] = out
        return cache[seed]

    return get


@pytest.mark.parametrize("learner", ["tp2", "ep2", "pp2", "tp2xep2xpp2"])
def test_fanout_into_parallel_engines_equals_the_single_process_engine(reference, learner):
    world, parallel = LAYOUTS[learner]
    seed = 30 + sorted(LAYOUTS).index(learner)
    ref = reference(seed)
    engines = ENGINES[world]
    results = pool(world).run(
        sync_engines_on_ranks, ref["state"], parallel, engines, ref["params"], timeout=TIMEOUT
    )
    for name in engines:
        worst, swapped = 0.0, float("inf")
        for rank, per_engine in enumerate(results):
            r = per_engine[name]
            assert r["wrong_params"] == [], (learner, name, rank, r["wrong_params"])
            assert r["received"] == r["share"], (learner, name, rank)  # its shard's bytes, each once
            worst = max(worst, max_delta(r["logprobs"], ref["logprobs"]))
            swapped = min(swapped, max_delta(r["k_v_swapped"], ref["logprobs"]))
            for kind in ("greedy", "sampled", "one_row"):
                expected = ref[kind] if kind == "one_row" else ref[kind][r["prompt_set"]]
                assert [g[0] for g in r[kind]] == [g[0] for g in expected], (learner, name, rank, kind)
                assert [g[2] for g in r[kind]] == [g[2] for g in expected]
                delta = max_delta([g[1] for g in r[kind]], [g[1] for g in expected])
                assert delta <= TOLERANCE, (learner, name, rank, kind, delta)
                worst = max(worst, delta)
        print(f"{learner} -> engine {name}: max |delta| {worst:.1e}, k/v swapped {swapped:.2f}")
        assert worst <= TOLERANCE
        assert swapped > 100 * TOLERANCE
    mixed = MIXED_BLOCK[world]  # its lockstep blocks hold two tp groups with prompt sets 0 and 1
    assert {g[2] for r in results for g in r[mixed]["greedy"]} == {"stop", "length"}


MEMORY_CONFIG = gpt_oss_tiny(
    vocab_size=1024, hidden_size=256, intermediate_size=256, head_dim=64, num_layers=4, num_experts=8
)


def measure_fanout_on_ranks(parallel: dict, engine_layout: dict, bucket_bytes: int) -> dict[str, int]:
    """(Every rank) peak RSS growth of one fan-out sync into this rank's engine shard, after a warm-up sync
    (the engine's own parameters exist before); allocations of 64 KiB and more are mmapped so that freed
    tensors leave the resident set at once. Also the largest transfer this rank roots and receives."""
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD
    config = MEMORY_CONFIG
    state = {n: p.detach() for n, p in build_model(config, seed=0).named_parameters()}
    chunks, dims = _stages(config, state, parallel)
    del state
    pcfg = ParallelConfig(
        tensor_model_parallel_size=engine_layout.get("tp", 1),
        expert_model_parallel_size=engine_layout.get("ep", 1),
    )
    edims = ParallelDims.build(pcfg, config)
    engine = ParallelEmbeddedEngine(config, edims)
    target = EngineLayout(workers=dims.layout.world, ep=edims.ep, expert_slices=True)
    exporter = FanoutExporter(chunks, config, dims, target, bucket_bytes)
    engine.update_weights(exporter.pairs())  # warm-up
    Path("/proc/self/clear_refs").write_text("5")
    before = _rss()["VmRSS"]
    engine.update_weights(exporter.pairs())
    peak = _rss()["VmHWM"] - before
    rank = dims.rank
    return {
        "rank": rank,
        "peak": peak,
        "rooted": max((t.nbytes for t in exporter.plan if t.root == rank), default=0),
        "received": max((t.nbytes for t in exporter.plan if rank in t.receivers), default=0),
    }


def test_fanout_peak_extra_memory_per_rank_is_bounded_by_the_bucket():
    bucket = 1 << 20
    world, parallel = LAYOUTS["tp2xep2xpp2"]
    per_rank = pool(world).run(measure_fanout_on_ranks, parallel, dict(tp=2, ep=4), bucket, timeout=TIMEOUT)
    model_bytes = 4 * MEMORY_CONFIG.param_counts()["total"]
    slack = 2 << 20  # allocator and gloo bookkeeping
    for m in per_rank:
        # a bucket received + a bucket rooted (kept until its sends complete) + the transfer in flight (a tp
        # gather and its HF copy) + the engine's conversion of one received transfer
        bound = 2 * bucket + 3 * m["rooted"] + m["received"] + slack
        print(f"fan-out rank {m['rank']}: peak {m['peak'] / 2**20:.2f} MiB, bound {bound / 2**20:.2f} MiB")
        assert m["peak"] <= bound, m
        assert bound < model_bytes / 2, (bound, model_bytes)


def engine_errors_on_ranks(state):
    """(Every rank) an ep2 engine on 2 ranks: what `update_weights` refuses."""
    edims = ParallelDims.build(ParallelConfig(expert_model_parallel_size=2), CONFIG)
    engine = ParallelEmbeddedEngine(CONFIG, edims)
    model = build_model(CONFIG)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(state[n])
    full = list(iter_hf_tensors(model, CONFIG))
    errors = {}

    def attempt(key, pairs):
        try:
            engine.update_weights(pairs)
        except CheckpointError as e:
            errors[key] = str(e)

    name = "model.layers.1.mlp.experts.down_proj"
    down = dict(full)[name]
    rest = [(n, t) for n, t in full if n != name]
    attempt("no_error", [*rest, (expert_slice_name(name, 0, 8), down)])  # a full-range slice: fine
    attempt("missing_experts", [*rest, (expert_slice_name(name, 0, 4), down[:4])])  # rank 1's part absent
    attempt("bad_slice", [*rest, (expert_slice_name(name, 0, 4), down[:3])])
    attempt("missing_v", [(n, t) for n, t in full if n != "model.layers.0.self_attn.v_proj.weight"])
    engine.sleep()
    try:
        engine.update_weights(full)
    except RuntimeError as e:
        errors["asleep"] = str(e)
    engine.wake_up()
    engine.update_weights(full)
    rank = edims.rank
    try:  # ep2 on 2 ranks: one lockstep block of two tp groups, which must decode as many steps
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=3 + rank))
    except ValueError as e:
        errors["steps"] = str(e)
    engine.shutdown()
    tp2 = ParallelEmbeddedEngine(
        CONFIG, ParallelDims.build(ParallelConfig(tensor_model_parallel_size=2), CONFIG)
    )
    try:  # tp ranks must pass the same prompts
        tp2.generate([[1, 2 + rank]], SamplingParams(max_new_tokens=2))
    except ValueError as e:
        errors["prompts"] = str(e)
    return errors


def test_engine_update_errors_are_named():
    per_rank = pool(2).run(engine_errors_on_ranks, learner_state(5), timeout=TIMEOUT)
    for rank, errors in enumerate(per_rank):
        assert "no_error" not in errors
        if rank == 0:  # experts 0-3 arrived: rank 0's part is complete
            assert "missing_experts" not in errors
        else:
            assert "layers.1.mlp.experts.linear_fc2.weight" in errors["missing_experts"]
        assert "has shape (3, 32, 32), expected (4, 32, 32)" in errors["bad_slice"]
        assert "model.layers.0.self_attn.v_proj.weight" in errors["missing_v"]
        assert "sleeps" in errors["asleep"]
        assert "max_new_tokens across its lockstep block" in errors["steps"]
        assert "prompts and sampling parameters across its tensor-parallel group" in errors["prompts"]
