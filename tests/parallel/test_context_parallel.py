"""Context parallelism against the single-process model (gloo, fp32): the loss, the global gradient norm
and every gradient of two AdamW steps (distributed optimizer), every parameter after them, and the
log-prob pass, on packed micro-batches whose documents cross the zig-zag chunk boundaries, with sinks
(perturbed away from 0) and both attention kinds (window 8 and full). cp2 splits a 32-token micro-batch
into 8-token chunks (the window layers exchange only each chunk's last 7 keys), cp4 into 4-token chunks
(the window reaches back past the previous chunk: its layers, like the full ones, pass key/value blocks
around the ring). One pool per world size runs
every layout of that size in one call."""

from __future__ import annotations

import pytest
import torch
from helpers.harness import pool
from helpers.sharded import rel_err, tiny_config
from test_layouts import DOCS, compare, reference_run, run_layout

from megatron_gptoss.config import ConfigError, ParallelConfig, load_config
from megatron_gptoss.parallel import context_parallel, ring_attention
from megatron_gptoss.parallel.context_parallel import ContextParallel, bucket_tokens, plan_chunk
from megatron_gptoss.parallel.dims import Layout, validate_layout

LAYERS = 2
CP2 = {"context_parallel_size": 2}


def _layouts(cases: list[tuple[dict, dict]]) -> list[dict]:
    """Every (parallel, options) case on this rank, one after the other. Option `drop_sinks`: the
    diagonal blocks run without the sinks (what a CP path that forgets them computes); `backend`: the
    diagonal blocks' kernel (the model's is eager)."""
    out = []
    for parallel, options in cases:
        options = dict(options)
        original = context_parallel.sink_attention
        if options.pop("drop_sinks", False):

            def without_sinks(q, k, v, sinks, original=original, **kwargs):
                return original(q, k, v, torch.full_like(sinks, float("-inf")), **kwargs)

            context_parallel.sink_attention = without_sinks
        backend = options.pop("backend", None)
        if backend is not None:

            def on_backend(*args, original=original, forced=backend, **kwargs):
                return original(*args, **{**kwargs, "backend": forced})

            context_parallel.sink_attention = on_backend
        try:
            out.append(run_layout(parallel, LAYERS, DOCS[1], options))
        finally:
            context_parallel.sink_attention = original
    return out


def _run(world: int, cases: list[tuple[dict, dict]]) -> list[list[dict]]:
    per_rank = pool(world).run(_layouts, cases)
    return [[rank[i] for rank in per_rank] for i in range(len(cases))]


def test_cp2_alone_with_experts_carved_from_cp_and_dropped_sinks_caught():
    ref = reference_run(LAYERS, DOCS[1])
    cases = [
        (CP2, {}),
        ({**CP2, "expert_model_parallel_size": 2}, {}),  # ep group = the cp group: {0, 1}
        (CP2, {"drop_sinks": True}),
    ]
    plain, experts, sabotaged = _run(2, cases)
    print("cp2", compare(plain, ref))
    print("cp2 x ep2", compare(experts, ref))
    with pytest.raises(AssertionError, match="error"):
        compare(sabotaged, ref)


def test_cp4_cp2_tp2_sp_and_cp2_pp2_equal_single_process():
    ref = reference_run(LAYERS, DOCS[1])
    cases = [
        ({"context_parallel_size": 4}, {}),
        ({**CP2, "tensor_model_parallel_size": 2, "sequence_parallel": True}, {}),
        ({**CP2, "pipeline_model_parallel_size": 2}, {}),
    ]
    for (parallel, _), per_rank in zip(cases, _run(4, cases)):
        print(parallel, compare(per_rank, ref))


def test_layout_rank_order_and_refused_layouts():
    layout = Layout(world=8, tp=2, pp=1, ep=4, cp=2)  # dp 2
    groups = layout.groups()
    assert groups["cp"][:2] == [[0, 2], [1, 3]] and groups["dp"][0] == [0, 4]
    assert groups["dp_cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]] and groups["ep"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for rank in range(8):
        c = layout.coords(rank)
        assert rank == c["tp"] + 2 * (c["cp"] + 2 * c["dp"])
    config = tiny_config()
    with pytest.raises(ConfigError, match="context_parallel_size=2"):
        validate_layout(ParallelConfig(context_parallel_size=2, tensor_model_parallel_size=2), config, 6)
    with pytest.raises(ConfigError, match="data-parallel x context-parallel"):
        validate_layout(ParallelConfig(context_parallel_size=2, expert_model_parallel_size=4), config, 2)
    with pytest.raises(ConfigError, match="multiple of 8"):
        ContextParallel(4, 0).check(12)


def _routing(layouts: list[dict]) -> list[tuple]:
    """Per layout: the log-probs and every token's experts of one packed micro-batch (documents across
    the chunks), then the log-probs with those experts replayed (split by cp like every input)."""
    from helpers.sharded import build_dims
    from helpers.stages import build_stages
    from test_layouts import BUDGET, batch_of

    from megatron_gptoss.parallel.pipeline import PipelineRunner

    out = []
    for parallel in layouts:
        config = tiny_config(num_layers=LAYERS)
        cfg, dims = build_dims(config, **parallel)
        models, plans = build_stages(config, dims, cfg)
        runner = PipelineRunner(models, plans, dims, chunk_size=16)
        b = batch_of(0, 0, DOCS[1][0][0])
        packed = runner.pack(b["input_ids"], b["targets"], b["valid"], BUDGET)
        lp, routing = runner.routed_logprobs(packed)
        replay = runner.pack(b["input_ids"], b["targets"], b["valid"], BUDGET, routing)
        out.append((lp, routing, runner.logprobs(replay)[0]))
    return out


def test_router_replay_under_cp2_equals_one_replica():
    """Captured routing is gathered back to token order, replayed routing is split like the tokens."""
    for (lp, routing, replayed), (ref_lp, ref_routing, _) in pool(2).run(_routing, [CP2, {}]):
        assert torch.equal(routing, ref_routing)
        assert rel_err(lp, ref_lp) < 1e-6 and rel_err(replayed, ref_lp) < 1e-6


def test_bitwise_on_policy_refuses_context_parallel():
    overrides = ["rollout.bitwise_on_policy=true", "model.attention_backend=triton"]
    with pytest.raises(ConfigError, match="parallel.context_parallel_size=1"):
        load_config(None, [*overrides, "rollout.engine=embedded", "parallel.context_parallel_size=2"])


def test_zigzag_split_and_chunk_plans():
    cp = ContextParallel(2, 1)
    assert cp.local_index(8).tolist() == [2, 3, 4, 5]  # chunks 1 and 2 of 4
    assert ContextParallel(2, 0).global_order(8).tolist() == [0, 1, 4, 5, 6, 7, 2, 3]
    bounds = [0, 5, 14, 16]  # documents [0, 5) [5, 14) [14, 16); chunks of 4
    plan = plan_chunk(bounds, 2, 4, None)  # tokens [8, 12): inside the document that starts at 5
    assert (plan.cu, plan.rows, plan.k_lo) == ([0, 4], 4, 5)
    plan = plan_chunk(bounds, 3, 4, 3)  # [12, 16): rows 12, 13 reach back 2 keys; 14 starts a document
    assert (plan.cu, plan.rows, plan.k_lo) == ([0, 2, 4], 2, 10)
    assert plan_chunk(bounds, 1, 4, None).rows == 1  # token 4 reads keys [0, 4)


def test_bucket_tokens_bounds_the_chunk_lengths_of_a_run():
    """Under cp a step's micro-batch length is rounded up to 2^k or 3 x 2^(k-1): never below it, below
    1.5x it, and every length from 1,000 to 200,000 tokens lands on one of 2 an octave."""
    lengths = range(1_000, 200_001, 7)
    buckets = {n: bucket_tokens(n) for n in lengths}
    assert all(n <= b < n * 1.5 for n, b in buckets.items())
    assert sorted(set(buckets.values())) == [
        1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768, 49152, 65536, 98304,
        131072, 196608, 262144,
    ][: len(set(buckets.values()))]  # fmt: skip
    assert [bucket_tokens(n) for n in (1, 2, 3, 5, 6, 7, 4097)] == [1, 2, 3, 6, 6, 8, 6144]


def _rect_cases(gen: torch.Generator, q_len: int, k_len: int, count: int):
    """`count` random rectangles inside q_len x k_len: (rows, (first, last) keys, q_start, k_start,
    window), windows None, narrow and wide, some rows seeing no key."""
    for case in range(count):
        rows = int(torch.randint(1, q_len + 1, (1,), generator=gen))
        first = int(torch.randint(0, k_len, (1,), generator=gen))
        last = int(torch.randint(first + 1, k_len + 1, (1,), generator=gen))
        window = (None, 8, 300, k_len)[case % 4]
        k_start = 37
        q_start = k_start + k_len + int(torch.randint(0, 50, (1,), generator=gen))
        yield rows, (first, last), q_start, k_start, window


def test_rect_block_mask_lists_exactly_the_blocks_a_rectangle_reaches():
    """The rectangle's block lists (built without its dense mask) hold exactly the 128 x 128 blocks with
    an allowed (query, key) pair, those it lists full have no masked pair, and its mask_mod is the exact
    mask: over random rectangles, windows
    none/8/300/all, on shapes that do and do not divide into blocks."""
    gen = torch.Generator().manual_seed(3)
    for q_len, k_len in [(256, 384), (200, 300), (130, 1000)]:
        i = torch.arange(q_len)[:, None]
        j = torch.arange(k_len)[None, :]
        whole_rect = (q_len, (0, k_len), 37 + k_len, 37, None)
        for rows, (first, last), q_start, k_start, window in [
            whole_rect,
            *_rect_cases(gen, q_len, k_len, 24),
        ]:
            offset = None if window is None else q_start - k_start - window
            exact = (i < rows) & (j >= first) & (j < last)
            if offset is not None:
                exact &= j > i + offset
            cpu = torch.device("cpu")
            mask = ring_attention.rect_block_mask(q_len, k_len, rows, (first, last), offset, cpu)
            pad = (0, -k_len % 128, 0, -q_len % 128)
            tiles = torch.nn.functional.pad(exact, pad).view(-(-q_len // 128), 128, -1, 128)
            whole = torch.nn.functional.pad(exact, pad, value=True).view_as(tiles)  # padding: allowed
            listed = mask.to_dense()[0, 0].bool()  # partial and full blocks
            assert torch.equal(listed, tiles.any(3).any(1)), (q_len, k_len, rows, first, last, window)
            full = torch.zeros_like(listed)
            for b, (n, idx) in enumerate(zip(mask.full_kv_num_blocks[0, 0], mask.full_kv_indices[0, 0])):
                full[b, idx[: int(n)].long()] = True
            assert not (full & ~whole.all(3).all(1)).any(), "a block with a masked pair is listed full"
            if rows == q_len and window is None:  # the whole rectangle: full but for ragged edge blocks
                assert full[: q_len // 128, : k_len // 128].all(), (q_len, k_len)
            applied = mask.mask_mod(0, 0, i.expand(q_len, k_len), j.expand(q_len, k_len))
            assert torch.equal(applied, exact), (q_len, k_len, rows, first, last, window)


def test_flex_rectangles_over_whole_chunks_equal_eager_forward():
    """`flex_rect_attention` over whole (padded) chunks against the eager reference on the rectangle's
    own rows and keys, forward (flex_attention has no CPU backward; the GPU test differentiates): O and
    LSE of the rectangle's rows, O = 0 and LSE = -inf past them and where the window hides every key."""
    gen = torch.Generator().manual_seed(4)
    q_len, k_len = 200, 300
    for rows, (first, last), q_start, k_start, window in _rect_cases(gen, q_len, k_len, 12):
        q = torch.randn(q_len, 4, 16, generator=gen)
        k, v = (torch.randn(k_len, 2, 16, generator=gen) for _ in "kv")
        with torch.no_grad():
            out, lse = ring_attention.flex_rect_attention(
                q, k, v, q_start, k_start, window, 0.25, rows, (first, last)
            )
        ref_out, ref_lse = ring_attention.eager_rect_attention(
            q[:rows], k[first:last], v[first:last], q_start, k_start + first, window, 0.25
        )
        seen = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse[:, :rows]), seen) and not torch.isfinite(lse[:, rows:]).any()
        assert rel_err(out[:rows], ref_out) < 1e-5 and not out[rows:].any()
        assert rel_err(lse[:, :rows][seen], ref_lse[seen]) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_rectangles_equal_eager_and_compile_once_per_shape():
    """The CUDA path of the earlier-keys block (flex_attention over whole chunks from FLEX_MIN_QUERIES
    rows, its LSE differentiated; shorter chunks eager) against the eager reference on the rectangle's own
    rows and keys, forward and backward, rows that see no key included; every rectangle after a shape's
    first runs under dynamo's error_on_recompile: other rows, keys and windows reuse its kernel."""
    gen = torch.Generator().manual_seed(0)
    for q_len, k_len in [(40, 56), (256, 384), (1024, 2048)]:
        cases = [(q_len, (0, k_len), 100 + k_len, 100, None), *_rect_cases(gen, q_len, k_len, 8)]
        for n, (rows, (first, last), q_start, k_start, window) in enumerate(cases):
            inputs = {name: torch.randn(length, h, 64, generator=gen).cuda()
                      for name, length, h in (("q", q_len, 8), ("k", k_len, 2), ("v", k_len, 2))}  # fmt: skip
            weights = [torch.randn(shape, generator=gen).cuda() for shape in ((rows, 8, 64), (8, rows))]
            results = []
            for ours in (False, True):
                leaves = {name: t.clone().requires_grad_() for name, t in inputs.items()}
                q, k, v = leaves["q"], leaves["k"], leaves["v"]
                with torch._dynamo.config.patch(error_on_recompile=n > 0):
                    if ours:
                        out, lse = ring_attention.rect_attention(
                            q, k, v, q_start, k_start, window, 0.125, rows, (first, last)
                        )
                    else:
                        out, lse = ring_attention.eager_rect_attention(
                            q[:rows], k[first:last], v[first:last], q_start, k_start + first, window, 0.125
                        )
                seen = torch.isfinite(lse)
                ((out * weights[0]).sum() + (lse.masked_fill(~seen, 0) * weights[1]).sum()).backward()
                results.append((out, lse.masked_fill(~seen, 0), seen, q.grad, k.grad, v.grad))
            ref, ours = results
            where = (q_len, k_len, rows, first, last, window)
            assert torch.equal(ref[2], ours[2]), where
            for name, a, b in zip(("out", "lse", "seen", "dq", "dk", "dv"), ref, ours):
                if name == "seen":
                    continue
                if not a.any():  # no row sees a key: nothing flows, exactly
                    assert not b.any(), (where, name)
                else:
                    assert rel_err(b, a) < 1e-5, (where, name, rel_err(b, a))


def _attention_errors(backend: str, windows: list[int | None]) -> dict[str, float]:
    """`ContextParallelAttention` (diagonal blocks on `backend`) of this cp rank's tokens of 16 packed
    tokens in chunks of 4 (documents [0, 3) [3, 9) [9, 16)), forward and backward, against the eager
    kernel on all 16: outputs gathered, q/k/v gradients of this rank's tokens, sink gradients summed."""
    import torch.distributed as dist

    from megatron_gptoss.model.attention import CoreAttention
    from megatron_gptoss.ops.sink_attention import sink_attention

    group = dist.new_group([0, 1])
    cp = ContextParallel(2, dist.get_rank(), group)
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(16, h, 16, generator=gen) for h in (4, 2, 2))
    weight = torch.randn(16, 4, 16, generator=gen)
    cu = torch.tensor([0, 3, 9, 16], dtype=torch.int32)
    out = {}
    for window in windows:
        core = CoreAttention(4, window, backend)
        with torch.no_grad():
            core.softmax_offset.copy_(torch.randn(4, generator=gen))
        sinks = core.softmax_offset.detach().clone().requires_grad_()
        ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = sink_attention(*ref_in, sinks, window=window, cu_seqlens=cu, max_seqlen=7, backend="eager")
        (ref * weight).sum().backward()
        mine = [cp.split(t, 0).detach().requires_grad_() for t in (q, k, v)]
        local = context_parallel.ContextParallelAttention(core, cp)(*mine, cu)
        full = cp.gather(local, 0)
        (full * weight).sum().backward()
        sink_grad = core.softmax_offset.grad.clone()
        dist.all_reduce(sink_grad, group=group)
        out[f"out w{window}"] = rel_err(full, ref)
        for name, ours, theirs in zip("qkv", mine, ref_in):
            out[f"d{name} w{window}"] = rel_err(ours.grad, cp.split(theirs.grad, 0))
        out[f"dsink w{window}"] = rel_err(sink_grad, sinks.grad)
    return out


def test_attention_blocks_on_the_triton_kernel():
    """The whole-layout tests run the eager kernel; here the diagonal blocks run ours (interpreted)."""
    # window 3: the previous chunk's last 2 keys are exchanged; 6 reaches past it (all keys); None: full
    per_rank = pool(2).run(_attention_errors, "triton", [3, 6, None])
    worst = max((err, name) for errs in per_rank for name, err in errs.items())
    assert worst[0] <= 1e-5, worst


def test_weight_sync_plan_sends_from_one_cp_replica():
    """The bridge's plan under tp2 x cp2 x dp2, ep4: dense shards come from the (dp 0, cp 0) replica only,
    experts from the ep owners, which span the cp ranks."""
    from megatron_gptoss.bridge.plan import EngineLayout, ParamInfo, plan_transfers
    from megatron_gptoss.checkpoint.dist_boxes import shard_spec_of
    from megatron_gptoss.hf.names import our_names

    config = tiny_config()
    layout = Layout(world=8, tp=2, pp=1, ep=4, cp=2)
    infos = [ParamInfo(name, (), "float32", shard_spec_of(name, 2)) for name in our_names(config)]
    plan = plan_transfers(layout, EngineLayout(), dict.fromkeys(range(8), infos), config, 1 << 20, dst=0)
    sources = {t.ours: t.sources for t in plan}
    assert sources["decoder.layers.0.self_attention.linear_qkv.weight"] == (0, 1)
    assert sources["decoder.layers.1.mlp.experts.linear_fc1.weight"] == (0, 1, 2, 3)
    assert sources["decoder.layers.1.pre_mlp_layernorm.weight"] == (0,)


def _ring_trace(kv_exchange: str, cases: list[tuple[int | None, list[int]]]) -> list[dict]:
    """Per (window, document bounds) case, cp4 over 32 packed tokens (chunks of 4): this rank's errors
    against the eager kernel on all 32 (output, q/k/v gradients, sinks gradient summed over cp), and what
    the attention sent: the point-to-point receives of the forward and of the backward (their element
    counts), the all-gathers issued on the cp group and the rectangles of earlier keys computed."""
    import torch.distributed as dist

    from megatron_gptoss.model.attention import CoreAttention
    from megatron_gptoss.ops.sink_attention import sink_attention

    group = dist.new_group([0, 1, 2, 3])
    cp = ContextParallel(4, dist.get_rank(), group)
    trace: dict = {}
    gather_names = [
        n for n in ("all_gather_single", "all_gather_into_tensor", "all_gather") if hasattr(dist, n)
    ]
    originals = {name: getattr(dist, name) for name in ["batch_isend_irecv", *gather_names]}
    rect = (ring_attention.rect_attention, context_parallel.rect_attention)

    def receives(ops):
        trace["recv"] += [op.tensor.numel() for op in ops if op.op is dist.irecv]
        return originals["batch_isend_irecv"](ops)

    def spy(name):
        def gather(out, local, group=None, **kwargs):
            trace["gathers"] += group is cp.group
            return originals[name](out, local, group=group, **kwargs)

        return gather

    def counted(fn):
        def rectangle(*args):
            trace["rects"] += 1
            return fn(*args)

        return rectangle

    gen = torch.Generator().manual_seed(11)
    results = []
    dist.batch_isend_irecv = receives
    for name in gather_names:
        setattr(dist, name, spy(name))
    ring_attention.rect_attention, context_parallel.rect_attention = counted(rect[0]), counted(rect[1])
    try:
        for window, bounds in cases:
            q, k, v = (torch.randn(32, h, 8, generator=gen) for h in (4, 2, 2))
            weight = torch.randn(32, 4, 8, generator=gen)
            cu = torch.tensor(bounds, dtype=torch.int32)
            core = CoreAttention(4, window, "eager")
            with torch.no_grad():
                core.softmax_offset.copy_(torch.randn(4, generator=gen))
            sinks = core.softmax_offset.detach().clone().requires_grad_()
            ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
            longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
            ref = sink_attention(*ref_in, sinks, window=window, cu_seqlens=cu, max_seqlen=longest)
            (ref * weight).sum().backward()
            mine = [cp.split(t, 0).detach().requires_grad_() for t in (q, k, v)]
            attention = context_parallel.ContextParallelAttention(core, cp, kv_exchange)
            trace.update(recv=[], gathers=0, rects=0)
            local = attention(*mine, cu)
            sent = {"forward": trace["recv"], "gathers": trace["gathers"], "rects": trace["rects"]}
            trace["recv"] = []
            full = cp.gather(local, 0)
            (full * weight).sum().backward()
            sent["backward"] = trace["recv"]
            sink_grad = core.softmax_offset.grad.clone()
            dist.all_reduce(sink_grad, group=group)
            errors = [rel_err(full, ref), rel_err(sink_grad, sinks.grad)]
            errors += [rel_err(ours.grad, cp.split(ref.grad, 0)) for ours, ref in zip(mine, ref_in)]
            results.append({**sent, "error": max(errors)})
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        ring_attention.rect_attention, context_parallel.rect_attention = rect
    return results


def test_full_layers_pass_key_value_blocks_around_a_ring_at_cp4():
    """A full layer at cp4 receives cp - 1 = 3 blocks of K/V (2 x 8 local tokens x 2 heads x 8, 1/cp of
    the layer's keys and values) and issues no all-gather on the cp group; its backward receives those 3
    blocks again and 4 dK/dV blocks (3 along the ring, the last one its own, home). Every rank computes
    the 7 rectangles its chunks r and 7 - r can see of one document; none when every document lies in one
    chunk (and then nothing is sent); window 6 reaches 2 chunks back (chunk 1 one, chunk 0 none). The
    all-gather setting is told apart by the same trace, and every case equals the one-process kernel."""
    one_doc, in_chunks = [0, 32], list(range(0, 33, 4))
    cases = [(None, one_doc), (None, in_chunks), (6, one_doc), (None, [0, 3, 9, 21, 32])]
    block = 2 * 8 * 2 * 8
    for rank, per_case in enumerate(pool(4).run(_ring_trace, "ring", cases)):
        full, apart, window, docs = per_case
        assert full["forward"] == [block] * 3 and full["gathers"] == 0, (rank, full)
        assert full["backward"] == [block] * 7 and full["rects"] == 7, (rank, full)
        assert apart["forward"] == apart["backward"] == [] and apart["rects"] == 0, (rank, apart)
        assert window["rects"] == [2, 3, 4, 4][rank] and window["gathers"] == 0, (rank, window)
        assert max(c["error"] for c in per_case) <= 1e-5, (rank, per_case)
    for rank, (gathered,) in enumerate(pool(4).run(_ring_trace, "all_gather", cases[:1])):
        assert gathered["forward"] == [] and gathered["gathers"] == 2 and gathered["error"] <= 1e-5
        assert gathered["rects"] == 1 + (rank > 0), (rank, gathered)


def _nccl_ring(rank: int, init_file: str) -> None:
    """cp2 on two GPUs (NCCL): `ContextParallelAttention` of 512 packed fp32 tokens in chunks of 128
    (documents across the chunk boundaries) on the ring, rectangles through flex_attention, against the
    eager kernel on one GPU, forward and backward; a full layer, a window wider than a chunk (ring) and
    one that fits."""
    import torch.distributed as dist

    from megatron_gptoss.model.attention import CoreAttention
    from megatron_gptoss.ops.sink_attention import sink_attention

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        cp = ContextParallel(2, rank, dist.new_group([0, 1]))
        gen = torch.Generator().manual_seed(5)
        bounds = [0, 100, 260, 400, 512]
        cu = torch.tensor(bounds, dtype=torch.int32)
        for window in (None, 160, 16):
            q, k, v = (torch.randn(512, h, 64, generator=gen).cuda() for h in (8, 2, 2))
            weight = torch.randn(512, 8, 64, generator=gen).cuda()
            core = CoreAttention(8, window, "eager").cuda()
            with torch.no_grad():
                core.softmax_offset.copy_(torch.randn(8, generator=gen))
            sinks = core.softmax_offset.detach().clone().requires_grad_()
            ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
            ref = sink_attention(*ref_in, sinks, window=window, cu_seqlens=cu.cuda(), max_seqlen=160)
            (ref * weight).sum().backward()
            mine = [cp.split(t, 0).detach().requires_grad_() for t in (q, k, v)]
            full = cp.gather(context_parallel.ContextParallelAttention(core, cp)(*mine, cu), 0)
            (full * weight).sum().backward()
            sink_grad = core.softmax_offset.grad.clone()
            dist.all_reduce(sink_grad, group=cp.group)
            errors = {"out": rel_err(full, ref), "dsink": rel_err(sink_grad, sinks.grad)}
            for name, ours, theirs in zip("qkv", mine, ref_in):
                errors[f"d{name}"] = rel_err(ours.grad, cp.split(theirs.grad, 0))
            assert max(errors.values()) <= 1e-5, (window, errors)
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_ring_on_nccl_two_gpus_equals_one(tmp_path):
    import torch.multiprocessing as mp

    context = mp.start_processes(
        _nccl_ring, args=(str(tmp_path / "pg"),), nprocs=2, join=False, start_method="spawn"
    )
    for _ in range(60):  # a bounded join: a desync fails after 5 minutes instead of hanging
        if context.join(timeout=5):
            return
    for process in context.processes:
        process.kill()
    raise TimeoutError("the two NCCL ranks did not finish in 5 minutes")
