"""Sink attention backends at GPT-OSS shapes: 64 query heads, 8 KV heads, head_dim 64, bf16, one GPU.

    python benchmarks/bench_attention.py                       # every case and backend that runs here
    python benchmarks/bench_attention.py --backends triton,sdpa --cases causal-4k,window128-16k
    python benchmarks/bench_attention.py --sweep --cases causal-16k   # time Triton tile configs (tuning)
    python benchmarks/bench_attention.py --paged 512 --paged-keys 600,1500   # the paged decode kernel's
                                    # tiles (the engine's decode rows), each against the decode tile

Times are medians of `triton.testing.do_bench` (L2 flushed between repeats): forward with autograd
recording, backward from the kept graph for a given dO (loss on the output only). `kernel ms` is the GPU
time of one forward + backward's kernels (torch.profiler over 10 passes, L2 not flushed): where it is well
below the total, the host's launches bound the case. FLOPs count the
visible (query, key) pairs exactly: forward 4 * head_dim * q_heads * pairs, backward 2.5x that.
Backends: triton (ours), triton1 (ours with the one-pass backward: dQ summed inside the dK/dV kernel in
key-block order, `KernelConfig.fused_dq`), fa4 (flash-attn-4 + learnable_sink, when installed; its dQ summed
by atomics, not repeatable), fa4det (flash-attn-4 with its deterministic backward: semaphore-ordered sums,
bitwise repeatable as ours is, so the like-for-like peer), flex (compiled
flex_attention, block mask built once outside the timing, LSE sink correction as the flex backend),
sdpa (scaled_dot_product_attention WITHOUT sinks, KV heads expanded beforehand; causal padded cases
only: a reference point), eager (our reference; 4k only, it materialises the scores).
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
import triton

from megatron_gptoss.ops import backend_available, eager_sink_attention, sink_attention

HQ, HKV, D = 64, 8, 64
CASES = {  # name: (batch, tokens per sequence, window, packed lengths)
    "causal-4k": (1, 4096, None, None),
    "causal-8k": (1, 8192, None, None),
    "causal-16k": (1, 16384, None, None),
    "window128-4k": (1, 4096, 128, None),
    "window128-8k": (1, 8192, 128, None),
    "window128-16k": (1, 16384, 128, None),
    "packed16-16k": (None, None, None, "random16"),
    "padded16x1k": (16, 1024, None, None),
}


def packed_lengths(total=16384, docs=16, seed=0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(total - 1, generator=g)[: docs - 1] + 1
    bounds = [0] + sorted(cuts.tolist()) + [total]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


def visible_pairs(case) -> int:
    batch, tokens, window, lengths = case
    seqs = lengths if lengths is not None else [tokens] * batch
    total = 0
    for n in seqs:
        if window is None:
            total += n * (n + 1) // 2
        else:
            w = min(window, n)
            total += w * (w + 1) // 2 + (n - w) * w
    return total


def make_case(name):
    batch, tokens, window, lengths = CASES[name]
    if lengths == "random16":
        lengths = packed_lengths()
    lead = (sum(lengths),) if lengths else (batch, tokens)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(*lead, h, D, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_()
        for h in (HQ, HKV, HKV)
    )
    sinks = torch.randn(HQ, generator=g, device="cuda").requires_grad_()
    kw = dict(window=window)
    if lengths:
        kw["cu_seqlens"] = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device="cuda").int()
        kw["max_seqlen"] = max(lengths)
    return (q, k, v, sinks), kw, visible_pairs((batch, tokens, window, lengths))


def flex_fn(inputs, kw):
    """Compiled flex_attention + LSE sink correction, the block mask built here, outside the timing."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from megatron_gptoss.ops.sink_attention import document_ids

    q, k, v, sinks = inputs
    window, cu = kw["window"], kw.get("cu_seqlens")
    packed = cu is not None
    tokens = q.shape[0] if packed else q.shape[1]
    doc = document_ids(cu, tokens)[0] if packed else None

    def mask_mod(b, h, qi, ki):
        ok = ki <= qi
        if window is not None:
            ok = ok & (ki > qi - window)
        if doc is not None:
            ok = ok & (doc[qi] == doc[ki])
        return ok

    batch = None if packed else q.shape[0]
    mask = create_block_mask(mask_mod, batch if batch and batch > 1 else None, None, tokens, tokens)
    attend = torch.compile(flex_attention, dynamic=False)

    def fn(q, k, v, sinks):
        qb, kb, vb = (t[None] if packed else t for t in (q, k, v))
        out, lse = attend(
            qb.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2), block_mask=mask, enable_gqa=True,
            return_lse=True,
        )  # fmt: skip
        total = torch.logaddexp(lse.float(), sinks.float().view(1, -1, 1))
        out = (out.float() * torch.exp(lse.float() - total).unsqueeze(-1)).to(q.dtype).transpose(1, 2)
        return out[0] if packed else out

    return fn


def sdpa_fn():
    def fn(q, k, v, sinks):
        group = q.shape[2] // k.shape[2]
        k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return out.transpose(1, 2)

    return fn


def backend_fn(name, inputs, kw, config=None):
    if name == "flex":
        return flex_fn(inputs, kw)
    if name == "sdpa":
        return sdpa_fn()
    if name == "eager":
        return lambda q, k, v, s: eager_sink_attention(q, k, v, s, **kw)
    if name == "triton" and config is not None:
        from megatron_gptoss.ops.triton_sink_attention import triton_sink_attention

        return lambda q, k, v, s: triton_sink_attention(q, k, v, s, config=config, **kw)
    if name == "fa4det":
        from megatron_gptoss.ops.fa4_sink_attention import fa4_sink_attention

        return lambda q, k, v, s: fa4_sink_attention(q, k, v, s, deterministic=True, **kw)
    if name == "triton1":  # the default tiles with the one-pass backward
        from dataclasses import replace

        from megatron_gptoss.ops import triton_sink_attention as tsa

        q = inputs[0]
        longest = kw.get("max_seqlen") or q.shape[1]
        base = tsa.default_config(D, q.dtype, kw["window"] is not None, q.device, longest)
        cfg = replace(base, fused_dq=True)
        return lambda q, k, v, s: tsa.triton_sink_attention(q, k, v, s, config=cfg, **kw)
    return lambda q, k, v, s: sink_attention(q, k, v, s, backend=name, **kw)


def applicable(name, case_name, q) -> bool:
    batch, tokens, window, lengths = CASES[case_name]
    if name == "sdpa":
        return window is None and lengths is None
    if name == "eager":
        return batch is not None and tokens is not None and batch * tokens <= 4096
    if name in ("fa4", "fa4det"):
        return backend_available("fa4", q)
    return True


def time_backend(fn, inputs, what=("fwd", "bwd")):
    q, k, v, sinks = inputs
    leaves = [q, k, v] + ([sinks] if sinks.requires_grad else [])
    res = {}
    if "fwd" in what:
        res["fwd"] = triton.testing.do_bench(
            lambda: fn(q, k, v, sinks), warmup=25, rep=100, return_mode="median"
        )
    if "bwd" in what:
        out = fn(q, k, v, sinks)
        dout = torch.randn_like(out)
        params = [t for t in leaves if t.requires_grad]

        def bwd():
            return torch.autograd.grad(out, params, dout, retain_graph=True, allow_unused=True)

        res["bwd"] = triton.testing.do_bench(bwd, warmup=25, rep=100, return_mode="median")
        del out
    return res


def run_table(backends, cases):
    rows = []
    for case_name in cases:
        inputs, kw, pairs = make_case(case_name)
        flops_fwd = 4 * D * HQ * pairs
        for name in backends:
            if not applicable(name, case_name, inputs[0]):
                continue
            try:
                fn = backend_fn(name, inputs, kw)
                t = time_backend(fn, inputs)
                t["kernels"] = kernel_ms(fn, inputs)
            except Exception as err:  # one backend failing (OOM, missing feature) must not stop the table
                print(f"{case_name} {name}: {type(err).__name__}: {str(err)[:200]}", flush=True)
                torch.cuda.empty_cache()
                continue
            total = t["fwd"] + t["bwd"]
            row = dict(case=case_name, backend=name, fwd_ms=t["fwd"], bwd_ms=t["bwd"], total_ms=total)
            row["kernel_ms"] = t["kernels"]
            row["fwd_tflops"] = flops_fwd / t["fwd"] / 1e9
            row["bwd_tflops"] = 2.5 * flops_fwd / t["bwd"] / 1e9
            row["total_tflops"] = 3.5 * flops_fwd / total / 1e9
            rows.append(row)
            print(json.dumps(row), flush=True)
        del inputs
        torch.cuda.empty_cache()
    return rows


def print_table(rows):
    by = {(r["case"], r["backend"]): r for r in rows}
    print(
        "\n| case | backend | fwd ms | bwd ms | total ms | fwd TF/s | bwd TF/s | total TF/s "
        "| triton total / this | kernel ms | triton kernels / this |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ours = by.get((r["case"], "triton"))
        ratio = f"{ours['total_ms'] / r['total_ms']:.2f}" if ours else "—"
        kernels = f"{ours['kernel_ms'] / r['kernel_ms']:.2f}" if ours else "—"
        print(
            f"| {r['case']} | {r['backend']} | {r['fwd_ms']:.3f} | {r['bwd_ms']:.3f} | {r['total_ms']:.3f} "
            f"| {r['fwd_tflops']:.0f} | {r['bwd_tflops']:.0f} | {r['total_tflops']:.0f} | {ratio} "
            f"| {r['kernel_ms']:.3f} | {kernels} |"
        )


SWEEP_FWD = [
    (128, 64, 4, 3),
    (128, 64, 8, 3),
    (128, 128, 8, 3),
    (128, 64, 8, 4),
    (64, 64, 4, 3),
    (64, 64, 4, 4),
]
SWEEP_FWD += [(64, 32, 4, 3), (64, 64, 2, 3), (32, 32, 2, 3)]
SWEEP_DKDV = [
    (64, 128, 8, 3),
    (64, 64, 4, 3),
    (32, 64, 4, 4),
    (32, 128, 4, 3),
    (64, 128, 4, 3),
    (32, 64, 4, 3),
]
SWEEP_DKDV += [(64, 64, 4, 4), (32, 32, 2, 3)]
SWEEP_DQ = [(128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3), (64, 32, 4, 3), (128, 64, 4, 3), (64, 64, 4, 4)]


def sweep_case(case_name):
    """Time each Triton kernel (forward, dQ, dK/dV, the one-pass backward and its preprocess) over tile
    configs."""
    from dataclasses import replace
    from functools import partial

    from megatron_gptoss.ops import triton_sink_attention as tsa

    def bench(fn, *args):
        return triton.testing.do_bench(partial(fn, *args), warmup=10, rep=50, return_mode="median")

    inputs, kw, _ = make_case(case_name)
    q, k, v, s = (t.detach() for t in inputs)
    window, cu, ms, scale = kw["window"], kw.get("cu_seqlens"), kw.get("max_seqlen"), D**-0.5
    base = tsa.default_config(D, q.dtype, window is not None, q.device, ms or q.shape[1])
    print(f"\n{case_name} default {base}", flush=True)
    out, lse = tsa._forward(q, k, v, s, cu, ms, window, scale, base)
    dout = torch.randn_like(out)
    sink_state = tsa._bwd_preprocess(q, k, s, out, lse, dout, None, cu, ms)  # row pairs, partials, d_sink
    pre_ms = bench(tsa._bwd_preprocess, q, k, s, out, lse, dout, None, cu, ms)
    print(f"  preprocess (one-pass only): {pre_ms:.3f} ms")
    trials = [
        ("fwd", c, dict(block_m=c[0], block_n=c[1], fwd_warps=c[2], fwd_stages=c[3])) for c in SWEEP_FWD
    ]
    for c in SWEEP_DKDV:
        trials.append(
            ("dkdv", c, dict(dkdv_block_m=c[0], dkdv_block_n=c[1], dkdv_warps=c[2], dkdv_stages=c[3]))
        )
    trials.append(("dkdv-unpaired", "default", dict(dkdv_pair=False)))
    for c in SWEEP_DQ:
        trials.append(("dq", c, dict(dq_block_m=c[0], dq_block_n=c[1], dq_warps=c[2], dq_stages=c[3])))
    for c in SWEEP_DKDV:
        fields = dict(dkdv_block_m=c[0], dkdv_block_n=c[1], dkdv_warps=c[2], dkdv_stages=c[3], fused_dq=True)
        trials.append(("dkdv+dq", c, fields))
    for part, c, fields in trials:
        cfg = replace(base, **fields)
        if part == "fwd":
            fn, args = tsa._forward, (q, k, v, s, cu, ms, window, scale, cfg)
        elif part == "dq":  # dQ with Delta and the d_sink partials
            fn, args = tsa._bwd_dq, (q, k, v, s, out, dout, lse, None, cu, ms, window, scale, cfg)
        elif part == "dkdv+dq":
            fn, args = tsa._bwd_fused, (q, k, v, dout, lse, *sink_state, cu, ms, window, scale, cfg)
        else:
            fn, args = tsa._bwd_dkdv, (q, k, v, dout, lse, *sink_state, cu, ms, window, scale, cfg)
        try:
            print(f"  {part} {c}: {bench(fn, *args):.3f} ms", flush=True)
        except Exception as err:  # a config that does not compile (shared memory) is reported, not fatal
            print(f"  {part} {c}: {type(err).__name__}: {str(err)[:120]}", flush=True)


# paged decode tiles tried by --paged: (block_m, block_n, warps, stages); None fields are the training
# tile's (its key block and stages: a row keeps its bits only with the training tile's key blocks)
PAGED_TILES = [
    (16, None, 1, None), (16, None, 2, None), (16, None, 4, None), (16, None, 4, 2), (32, None, 2, None),
    (64, None, 4, None), (16, 32, 1, None), (16, 128, 4, None),
]  # fmt: skip


def paged_case(rows: int, keys: int, window: int | None, device, dtype, hq=HQ, hkv=HKV, d=D, page=16, seed=0):
    """`triton_paged_decode`'s inputs for `rows` rows whose query sits at position keys - 1, their blocks
    scattered over the pool (a window's table starts at the row's first block it sees)."""
    g = torch.Generator().manual_seed(seed)
    first = 0 if window is None else max(0, keys - window) // page
    view = -(-keys // page) - first
    blocks = rows * view + 1
    k, v = (torch.randn(blocks, page, hkv, d, generator=g).to(device, dtype) for _ in range(2))
    q = torch.randn(rows, hq, d, generator=g).to(device, dtype)
    sinks = torch.randn(hq, generator=g).to(device)
    table = (torch.randperm(blocks - 1, generator=g)[: rows * view] + 1).view(rows, view).to(device)
    positions = torch.full((rows,), keys - 1, device=device)
    return q, k, v, sinks, table, positions, positions - first * page


def paged_sweep(rows: int, keys_list: list[int], device, dtype, timer, **shape) -> list[dict]:
    """Each `PAGED_TILES` tile of the paged decode kernel against the decode tile (`decode_config` of the
    training forward's), full attention and the 128-key window, timed by `timer(fn)` (ms): its error
    against the decode tile's output (||a - b|| / ||b||; 0: the same bits) and its key/value bytes a
    second. Returns the rows printed."""
    from dataclasses import replace

    from megatron_gptoss.ops.triton_paged_decode import decode_config, triton_paged_decode
    from megatron_gptoss.ops.triton_sink_attention import default_config

    out = []
    print("| keys | window | tile | us | TB/s | error against the decode tile |\n|---|---|---|---|---|---|")
    for keys in keys_list:
        for window in (None, 128):
            args = paged_case(rows, keys, window, device, dtype, **shape)
            q, hkv = args[0], args[1].shape[2]
            trained = default_config(q.shape[-1], dtype, window is not None, q.device)
            tile = decode_config(trained, q.shape[1] // hkv)
            seen = min(keys, window or keys)
            gbytes = rows * seen * hkv * q.shape[-1] * 2 * args[1].element_size() / 1e9
            trials = [("decode tile", tile)]
            for m, n, w, st in PAGED_TILES:
                cfg = replace(trained, block_m=m, block_n=n or trained.block_n, fwd_warps=w,
                              fwd_stages=st or trained.fwd_stages)  # fmt: skip
                trials.append((f"{m} x {cfg.block_n} keys, {w} warps, {cfg.fwd_stages} stages", cfg))
            ref = triton_paged_decode(*args, window=window, config=trained)  # the engine's: the decode tile
            for name, cfg in trials:
                try:  # each tile as given (`tile`): not mapped to its decode tile as a training config is
                    run = functools.partial(triton_paged_decode, *args, window=window, tile=cfg)
                    got, ms = run(), timer(run)
                except Exception as err:  # a tile that does not compile is reported, not fatal
                    print(f"| {keys} | {window} | {name} | {type(err).__name__} | | |")
                    continue
                err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
                row = dict(keys=keys, window=window, tile=name, us=1e3 * ms, tbs=gbytes / ms, error=err)
                out.append(row)
                print(f"| {keys} | {window} | {name} | {row['us']:.1f} | {row['tbs']:.2f} | {err:.1e} |")
    return out


def _profiled_passes(fn, inputs, steps):
    """torch.profiler over `steps` forward + backward passes (after three unprofiled ones)."""
    params = [t for t in inputs if t.requires_grad]
    dout = None
    for _ in range(3):
        out = fn(*inputs)
        dout = torch.randn_like(out) if dout is None else dout
        torch.autograd.grad(out, params, dout, allow_unused=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            torch.autograd.grad(fn(*inputs), params, dout, allow_unused=True)
        torch.cuda.synchronize()
    return prof


def kernel_ms(fn, inputs, steps=10) -> float:
    """GPU time of the kernels of one forward + backward (L2 not flushed): the pass without the host's
    launch costs, which bound the small cases' wall times."""
    prof = _profiled_passes(fn, inputs, steps)
    device_us = sum(e.self_device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA")
    return device_us / 1e3 / steps


def profile_case(case_name, backend="triton", steps=10):
    """CUDA time per kernel over `steps` forward+backward passes (torch.profiler)."""
    inputs, kw, _ = make_case(case_name)
    prof = _profiled_passes(backend_fn(backend, inputs, kw), inputs, steps)
    print(f"\n{case_name} {backend}: {steps} forward+backward passes")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=50))


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backends", default="triton,fa4,fa4det,flex,sdpa,eager")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--sweep", action="store_true", help="time Triton tile configs instead")
    parser.add_argument("--profile", action="store_true", help="per-kernel CUDA times of --backends instead")
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--paged", type=int, default=0, help="time the paged decode tiles at this many rows")
    parser.add_argument("--paged-keys", default="600,1500", help="--paged: each row's keys, comma-separated")
    args = parser.parse_args()
    torch._dynamo.config.cache_size_limit = 64
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    if args.paged:
        keys = [int(k) for k in args.paged_keys.split(",")]
        print(f"paged decode: {args.paged} rows, {HQ} query / {HKV} KV heads, head_dim {D}, bf16, page 16")
        paged_sweep(
            args.paged,
            keys,
            torch.device("cuda"),
            torch.bfloat16,
            lambda fn: triton.testing.do_bench(fn, rep=200),
        )
        return
    if args.sweep:
        for case_name in args.cases.split(","):
            sweep_case(case_name)
        return
    if args.profile:
        for case_name in args.cases.split(","):
            for name in args.backends.split(","):
                profile_case(case_name, name)
        return
    rows = run_table(args.backends.split(","), args.cases.split(","))
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
