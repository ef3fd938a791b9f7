"""Weight-sync benchmark: a gpt-oss-120b-width learner slice (hidden 2880, 64 query / 8 KV heads of 64,
intermediate 2880, all 128 experts, --layers layers, vocabulary --vocab) in bf16, expert parallel over all
GPUs (NCCL), exported through the bridge into a colocated receiver, on 1, 2 or 4 GPUs:

    torchrun --nproc_per_node 4 benchmarks/bench_weight_sync.py
    torchrun --nproc_per_node 2 benchmarks/bench_weight_sync.py --tiny      # a CPU check of the logic (gloo)

Three paths are timed, each after one untimed warm-up pass:
  (b) gathered  WeightExporter (whole experts, EngineLayout()) -> sync_in_process -> the embedded engine on
                GPU 0 (rank 0 = dst: it receives every byte of the model; the other ranks send their experts
                over NCCL gathers). The engine is a full single-GPU model: it takes whole HF tensors only.
  (a) local     each rank turns its own experts into HF layout with the bridge's name table (`to_hf` on
                expert-range slices of at most --bucket-mb) and copies them into receiver-owned tensors on
                the same GPU: the conversion alone, without an engine's load path.
  (c) fan-out   FanoutExporter -> a ParallelEmbeddedEngine with a shard on every GPU (engine world = learner
                world): dense tensors broadcast from their root to every GPU, each engine rank narrows them
                to its shard; expert slices converted on the GPU that holds them where the engine's expert
                layout matches, else sent point to point to the GPU whose engine shard takes them. Two
                engine layouts: ep = #GPUs (experts match the learner's) and tp2 x ep #GPUs/2 (another
                layout: half or all of a GPU's experts come from other GPUs). Timed as a whole and per pass
                (dense, experts); GB/s per GPU = the bytes its engine shard takes / seconds.
Before timing, each path is checked bit for bit: (b) every engine parameter equals the learner's (expert
shards gathered onto rank 0); (c) every engine shard equals the learner's tensor narrowed to that shard
(dense: against the rank's replicated learner copy; experts: against each owner's broadcast). Peak extra
memory = max_memory_allocated during the pass minus memory_allocated before it (the engines' and the
receivers' own parameters excluded).

Projection for the full gpt-oss-120b (36 layers, vocabulary 201088) with the learner at pp4 x ep8 on 32
and 64 H100s (8 GPUs a node; a pipeline stage spans whole nodes, so 3/4 of what a GPU receives comes from
other nodes). Bytes (bf16): X = all expert tensors, D = all dense tensors (attention, norms, router, sinks,
embedding, output layer). Every GPU hosts an engine shard and receives in parallel (path (c)).
    (a) matching expert layout: a GPU keeps its learner experts, X / (pp ep), converted into its engine
        shard at r_local, and receives every dense tensor:
                                  t_a = X / (pp ep) / r_local + D (1/4 / r_dense + 3/4 / min(r_dense, net))
    (b) any other layout, e.g. one engine per node with experts split over its 8 GPUs (ep_e = 8) or over 2
        nodes (ep_e = 16), dense replicated:
                                  t_b = X / ep_e (1/4 / r_recv + 3/4 / min(r_recv, net)) + the dense term
    r_local: (c) with matching experts, experts GB per GPU / experts-pass seconds; r_dense: its dense GB per
    GPU / dense-pass seconds; r_recv: (c) with the other layout, experts GB per GPU / experts-pass seconds
    (on one GPU, where there is no other layout: the dst rate of (b)); net = --link-gbs, the per-GPU
    inter-node bandwidth (assumed, not measured: 400 Gb/s InfiniBand per GPU = 50 GB/s). "one dst": the
    whole model through one GPU, (X + D) (1/4 / r_dst + 3/4 / min(r_dst, net)), r_dst the (b) rate.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from megatron_gptoss.bridge.export import WeightExporter
from megatron_gptoss.bridge.fanout import FanoutExporter
from megatron_gptoss.bridge.plan import EngineLayout, buckets_of
from megatron_gptoss.bridge.transport import sync_in_process
from megatron_gptoss.config import ParallelConfig, gpt_oss_120b
from megatron_gptoss.hf.names import hf_shapes, match_ours, our_names, to_hf
from megatron_gptoss.parallel.apply import parallelize
from megatron_gptoss.parallel.dims import ParallelDims
from megatron_gptoss.parallel.loading import init_parallel, materialize
from megatron_gptoss.parallel.pipeline import StagePlan, build_stage_model
from megatron_gptoss.parallel.sharding import get_shard, local_shard
from megatron_gptoss.rollout import EmbeddedEngine, SamplingParams
from megatron_gptoss.rollout.parallel_embedded import ParallelEmbeddedEngine

GB = 1e9
VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


def model_config(args):
    if args.tiny:
        return gpt_oss_120b(
            num_layers=2,
            vocab_size=200,
            hidden_size=64,
            intermediate_size=64,
            num_attention_heads=4,
            num_query_groups=2,
            head_dim=16,
            num_experts=8,
            sliding_window=16,
            attention_backend="eager",
        )
    return gpt_oss_120b(num_layers=args.layers, vocab_size=args.vocab)


def hf_bytes(config, element: int = 2) -> tuple[int, int]:
    """(expert bytes, dense bytes) of the whole model's HF tensors."""
    experts = dense = 0
    for name in our_names(config):
        n = sum(torch.Size(s).numel() for s in hf_shapes(match_ours(name), config)) * element
        if ".mlp.experts." in name:
            experts += n
        else:
            dense += n
    return experts, dense


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Peak:
    """max_memory_allocated during a pass minus memory_allocated before it (0 on the CPU)."""

    def __init__(self, device):
        self.device, self.cuda = device, device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc):
        self.extra = torch.cuda.max_memory_allocated(self.device) - self.base if self.cuda else 0


@torch.no_grad()
def check_bitwise(model, engine, config, dims, device) -> int:
    """Tensors where the engine differs from the learner (expert shards gathered onto rank 0)."""
    wrong = 0
    theirs = dict(engine.model.named_parameters()) if engine is not None else {}
    for name, p in model.named_parameters():
        spec = get_shard(p)
        if spec is not None and spec.group == "ep":
            full = p.new_empty((p.shape[0] * dims.ep, *p.shape[1:])) if dims.rank == 0 else None
            pieces = list(full.chunk(dims.ep)) if full is not None else None
            dist.gather(p.detach().contiguous(), pieces, dst=0, group=dims.group("ep"))
        elif spec is None:
            full = p.detach() if dims.rank == 0 else None
        else:
            raise ValueError(f"{name}: this benchmark runs tp1 only, got {spec}")
        if dims.rank == 0:
            rows = config.vocab_size if name in VOCAB_PARAMS else None
            if not torch.equal(theirs[name][:rows], full[:rows]):
                wrong += 1
                print(f"MISMATCH {name}", flush=True)
        del full
    return wrong


def local_receivers(model, config, device) -> dict[str, list[torch.Tensor]]:
    """Receiver-owned HF-layout tensors for this rank's experts (an engine whose experts match ours)."""
    out = {}
    for name, p in model.named_parameters():
        if ".mlp.experts." in name:
            one = to_hf(match_ours(name), p[:1].detach(), config)
            out[name] = [t.new_empty((p.shape[0], *t.shape[1:])) for _, t in one]
    return out


@torch.no_grad()
def local_pass(model, config, receivers, bucket_bytes: int) -> int:
    """Path (a): this rank's experts -> HF layout (to_hf on expert ranges of <= bucket_bytes) -> receivers."""
    moved = 0
    for name, p in model.named_parameters():
        if name not in receivers:
            continue
        step = max(1, bucket_bytes // (p[0].numel() * p.element_size()))
        for a in range(0, p.shape[0], step):
            for (_, t), dest in zip(to_hf(match_ours(name), p[a : a + step], config), receivers[name]):
                dest[a : a + step].copy_(t)
                moved += t.numel() * t.element_size()
    return moved


def gather_rows(row: torch.Tensor, world: int) -> list[list[float]]:
    rows = [torch.empty_like(row) for _ in range(world)]
    dist.all_gather(rows, row)
    return [r.tolist() for r in rows]


def timed(fn, device, dims, warmup: int, iters: int):
    """Median seconds (max over ranks), last pass's result and peak extra memory of `fn`."""
    times, peaks = [], []
    for it in range(warmup + iters):
        dist.barrier()
        sync(device)
        with Peak(device) as peak:
            start = time.perf_counter()
            result = fn()
            sync(device)
            elapsed = time.perf_counter() - start
        if it >= warmup:
            times.append(elapsed)
            peaks.append(peak.extra)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t), result, max(peaks)


@torch.no_grad()
def engine_outputs(engine, config) -> dict:
    """Log-probs of two fixed sequences, 8 greedy tokens of two prompts (collective for a sharded engine)."""
    gen = torch.Generator().manual_seed(0)
    seqs = torch.randint(0, config.vocab_size, (2, 24), generator=gen).tolist()
    outs = engine.generate([s[:8] for s in seqs], SamplingParams(top_k=1, max_new_tokens=8))
    return {
        "logprobs": engine.sequence_logprobs(seqs),
        "tokens": [o.token_ids for o in outs],
        "token_logprobs": [o.logprobs for o in outs],
    }


def compare_outputs(ours: dict, ref: dict) -> dict:
    """Max |log-prob delta| of the sequences, greedy tokens equal before the first divergence, and the max
    |delta| of the sampled tokens' log-probs over that common prefix."""
    seq = max(abs(a - b) for ra, rb in zip(ours["logprobs"], ref["logprobs"]) for a, b in zip(ra, rb))
    same, gen = 0, 0.0
    for ta, tb, la, lb in zip(ours["tokens"], ref["tokens"], ours["token_logprobs"], ref["token_logprobs"]):
        n = next((i for i, (a, b) in enumerate(zip(ta, tb)) if a != b), len(ta))
        same += n
        gen = max([gen, *(abs(a - b) for a, b in zip(la[: n + 1], lb[: n + 1]))])
    return {
        "seq_delta": seq,
        "greedy_equal": same,
        "greedy_total": sum(len(t) for t in ref["tokens"]),
        "gen_delta": gen,
    }


def fanout_layouts(world: int) -> list[tuple[str, int, int]]:
    """(name, tp, ep) of the engines path (c) feeds: experts matching the learner's, and another layout."""
    out = [(f"ep{world}", 1, world)]
    if world >= 2:
        out.append((f"tp2xep{world // 2}" if world > 2 else "tp2", 2, world // 2))
    return out


@torch.no_grad()
def check_fanout(model, engine, config, dims, edims) -> int:
    """Engine tensors of this rank that differ from the learner's narrowed to its engine shard: dense ones
    against this rank's learner copy (tp1: dense is replicated), experts against each owner's broadcast."""
    wrong = 0
    theirs = dict(engine.model.named_parameters())
    padded = config.padded_vocab_size(edims.tp)
    for name, p in model.named_parameters():
        mine = theirs[name]
        if get_shard(p) is None:
            if not torch.equal(mine, local_shard(p.detach(), get_shard(mine), edims, padded)):
                wrong += 1
                print(f"MISMATCH rank {dims.rank} {name}", flush=True)
            continue
        per, first = p.shape[0], edims.coord("ep") * mine.shape[0]
        for owner in range(dims.ep):  # learner tp1 pp1: rank = ep rank
            theirs_owner = p.detach() if dims.rank == owner else torch.empty_like(p)
            if dims.ep > 1:
                dist.broadcast(theirs_owner, src=owner)
            lo, hi = max(owner * per, first), min((owner + 1) * per, first + mine.shape[0])
            if lo < hi and not torch.equal(
                mine[lo - first : hi - first], theirs_owner[lo - owner * per : hi - owner * per]
            ):
                wrong += 1
                print(f"MISMATCH rank {dims.rank} {name} experts [{lo}, {hi})", flush=True)
    return wrong


def fanout_bytes(plan, rank: int, element: int = 2) -> dict[str, int]:
    """What this rank's engine worker receives: dense tensors, experts converted locally, experts received."""
    out = {"dense": 0, "local": 0, "remote": 0}
    for t in plan:
        if rank in t.receivers:
            n = sum(torch.Size(s).numel() for s in t.shapes) * element
            out["dense" if t.phase == "dense" else "local" if t.root == rank else "remote"] += n
    return out


def fanout_stream(exporter, device, marks: dict):
    """The exporter's pairs, marking when the experts pass starts (after the dense pass completes)."""
    phases = [b[0].phase for b in buckets_of(exporter.plan)]
    buckets = exporter.buckets()
    for phase in phases:
        if phase == "experts" and "experts" not in marks:
            sync(device)
            marks["experts"] = time.perf_counter()
        yield from next(buckets)
    next(buckets, None)


def timed_fanout(exporter, engine, device, warmup: int, iters: int):
    """Median seconds (max over ranks) of the whole sync, its dense pass and its experts pass; peak extra."""
    times, peaks = [], []
    for it in range(warmup + iters):
        dist.barrier()
        sync(device)
        marks: dict = {}
        with Peak(device) as peak:
            start = time.perf_counter()
            engine.update_weights(fanout_stream(exporter, device, marks))
            sync(device)
            end = time.perf_counter()
        if it >= warmup:
            split = marks.get("experts", end)
            times.append((end - start, split - start, end - split))
            peaks.append(peak.extra)
    t = torch.tensor(
        [statistics.median(x[i] for x in times) for i in range(3)], dtype=torch.float64, device=device
    )
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist(), max(peaks)


def projection(rates: dict[str, float], link: float) -> list[dict]:
    """The formula of the module docstring for the full gpt-oss-120b, learner pp4 x ep8."""
    full = gpt_oss_120b()
    x, d = hf_bytes(full)
    pp, ep, remote = 4, 8, 3 / 4

    def over_net(b: float, rate: float) -> float:
        return b * ((1 - remote) / rate + remote / min(rate, link))

    dense = over_net(d, rates["dense"])
    rows = []
    for gpus in (32, 64):
        mine = x / (pp * ep)
        rows.append(
            dict(
                gpus=gpus,
                case="(a) matching experts",
                received=d,
                local=mine,
                s=mine / rates["local"] + dense,
            )
        )
        for ep_e in (8, 16) if gpus == 64 else (8,):
            b = x / ep_e
            s_b = over_net(b, rates["recv"]) + dense
            rows.append(dict(gpus=gpus, case=f"(b) engine ep{ep_e}", received=b + d, local=0.0, s=s_b))
    one = over_net(x + d, rates["dst"])
    rows.append(dict(gpus=32, case="one dst (gathered path)", received=x + d, local=0.0, s=one))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=201088)
    parser.add_argument("--bucket-mb", type=int, default=1024, help="bucket size in MiB")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--link-gbs", type=float, default=50.0, help="assumed inter-node GB/s per GPU")
    parser.add_argument(
        "--generate", action=argparse.BooleanOptionalAction, default=True,
        help="compare each sharded engine's log-probs and greedy tokens with the single-GPU engine's",
    )  # fmt: skip
    parser.add_argument(
        "--dtype", default="bfloat16", choices=["bfloat16", "float32"],
        help="learner and engines (the projection assumes bf16 bytes)",
    )  # fmt: skip
    parser.add_argument("--tiny", action="store_true", help="tiny widths on the CPU (gloo)")
    parser.add_argument("--watchdog", type=int, default=0, help="dump stacks and exit after N s (0: off)")
    parser.add_argument("--out", default="", help="append the result as a JSON line to this file")
    args = parser.parse_args()
    if args.watchdog:
        faulthandler.dump_traceback_later(args.watchdog, exit=True)

    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    world = dist.get_world_size()
    config = model_config(args)
    pcfg = ParallelConfig(expert_model_parallel_size=world)
    dims = ParallelDims.build(pcfg, config)
    log = print if dims.rank == 0 else (lambda *a, **k: None)
    bucket = args.bucket_mb << 20

    dtype = getattr(torch, args.dtype)
    stage = build_stage_model(config, StagePlan(0, 1, range(config.num_layers)), dtype, "meta")
    model = parallelize(stage, dims, pcfg)
    materialize(model, device)
    init_parallel([model], config, dims, seed=0)
    engine = EmbeddedEngine(config, dtype=dtype, device=device) if dims.rank == 0 else None
    exporter = WeightExporter([model], config, dims, EngineLayout(), bucket, dst=0)
    receivers = local_receivers(model, config, device)

    # correctness: one sync, then every engine tensor against the learner's, bit for bit
    sync_in_process(exporter.buckets(), engine, is_dst=dims.rank == 0)
    wrong = torch.tensor([check_bitwise(model, engine, config, dims, device)], device=device)
    dist.all_reduce(wrong)
    n_params = len(list(model.named_parameters()))
    log(f"bitwise check after one sync: {n_params - int(wrong)}/{n_params} tensors equal", flush=True)
    if int(wrong):
        raise SystemExit("the engine's weights differ from the learner's")
    reference = [engine_outputs(engine, config) if engine is not None else None]
    dist.broadcast_object_list(reference, src=0)

    # (b) gathered into the engine on GPU 0
    total = sum(t.nbytes for t in exporter.plan)
    sent = sum(t.nbytes / len(t.sources) for t in exporter.plan if dims.rank in t.sources and dims.rank != 0)
    moved_b = total if dims.rank == 0 else sent
    t_b, _, peak_b = timed(
        lambda: sync_in_process(exporter.buckets(), engine, is_dst=dims.rank == 0),
        device, dims, args.warmup, args.iters,
    )  # fmt: skip
    # (a) local: experts stay on their GPU
    t_a, moved_a, peak_a = timed(
        lambda: local_pass(model, config, receivers, bucket), device, dims, args.warmup, args.iters
    )

    row = torch.tensor([moved_b, peak_b, moved_a, peak_a], dtype=torch.float64, device=device)
    per_rank = gather_rows(row, world)
    r_recv = total / t_b
    r_local = statistics.median(r[2] for r in per_rank) / t_a
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    log(
        f"\n{name} x {world}, learner ep{world} tp1 pp1, {config.num_layers} layers x {config.num_experts} "
        f"experts, hidden {config.hidden_size}, vocab {config.vocab_size}, {args.dtype}, "
        f"bucket {args.bucket_mb} MiB; model {total / GB:.2f} GB (HF tensors)\n"
        f"(b) gathered into the engine on GPU 0: {t_b:.3f} s   (a) local experts to HF layout: {t_a:.3f} s\n"
        "| rank | (b) GB moved | (b) GB/s | (b) peak extra GiB | (a) GB | (a) GB/s | (a) peak extra GiB |\n"
        "|---|---|---|---|---|---|---|"
    )
    for rank, (mb, pb, ma, pa) in enumerate(per_rank):
        role = "recv" if rank == 0 else "send"
        log(f"| {rank} | {mb / GB:.2f} {role} | {mb / GB / t_b:.1f} | {pb / 2**30:.2f} | {ma / GB:.2f} | "
            f"{ma / GB / t_a:.1f} | {pa / 2**30:.2f} |")  # fmt: skip
    engine = exporter = receivers = None  # free the single-GPU engine before the sharded ones
    if cuda:
        torch.cuda.empty_cache()

    # (c) fan-out into the sharded embedded engine colocated with the learner, one engine layout at a time
    fanout = {}
    for label, tp_e, ep_e in fanout_layouts(world):
        ecfg = ParallelConfig(tensor_model_parallel_size=tp_e, expert_model_parallel_size=ep_e)
        edims = ParallelDims.build(ecfg, config)
        shard = ParallelEmbeddedEngine(config, edims, dtype=dtype, device=device)
        fan = FanoutExporter([model], config, dims, EngineLayout(world, ep_e, True), bucket)
        shard.update_weights(fan.pairs())
        bad = torch.tensor([check_fanout(model, shard, config, dims, edims)], device=device)
        dist.all_reduce(bad)
        log(f"\n(c) engine {label}: bitwise check after one sync: {int(bad)} tensors differ", flush=True)
        if int(bad):
            raise SystemExit(f"the {label} engine's shards differ from the learner's")
        (t_all, t_dense, t_exp), peak_c = timed_fanout(fan, shard, device, args.warmup, args.iters)
        got = fanout_bytes(fan.plan, dims.rank, dtype.itemsize)
        rows_c = gather_rows(
            torch.tensor(
                [got["dense"], got["local"], got["remote"], peak_c], dtype=torch.float64, device=device
            ),
            world,
        )
        fanout[label] = dict(seconds=t_all, dense_s=t_dense, experts_s=t_exp, per_rank=rows_c)
        log(
            f"(c) fan-out into engine {label} (tp{tp_e} ep{ep_e}) on every GPU: {t_all:.3f} s "
            f"(dense pass {t_dense:.3f} s, experts pass {t_exp:.3f} s)\n"
            "| rank | dense GB (broadcast) | experts GB local | experts GB received | GB/s per GPU | "
            "dense GB/s | experts GB/s | peak extra GiB |\n|---|---|---|---|---|---|---|---|"
        )
        for rank, (dn, lo, rm, pk) in enumerate(rows_c):
            log(f"| {rank} | {dn / GB:.2f} | {lo / GB:.2f} | {rm / GB:.2f} | "
                f"{(dn + lo + rm) / GB / t_all:.1f} | {dn / GB / t_dense:.1f} | "
                f"{(lo + rm) / GB / t_exp:.1f} | {pk / 2**30:.2f} |")  # fmt: skip
        if args.generate:
            agree = compare_outputs(engine_outputs(shard, config), reference[0])
            fanout[label]["vs_single_gpu_engine"] = agree
            log(
                f"(c) engine {label} against the single-GPU embedded engine ({args.dtype}): sequence "
                f"log-probs max |delta| {agree['seq_delta']:.3g}; greedy tokens equal "
                f"{agree['greedy_equal']}/{agree['greedy_total']} (until a divergence), their log-probs "
                f"max |delta| {agree['gen_delta']:.3g}",
                flush=True,
            )
        del shard, fan
        if cuda:
            torch.cuda.empty_cache()

    match = fanout[f"ep{world}"]
    dense_bytes = match["per_rank"][0][0]
    rates = {
        "local": statistics.median(r[1] for r in match["per_rank"]) / match["experts_s"],
        "dense": dense_bytes / match["dense_s"],
        "dst": r_recv,
    }
    other = [v for k, v in fanout.items() if k != f"ep{world}"]
    rates["recv"] = (
        min((r[1] + r[2]) for r in other[0]["per_rank"]) / other[0]["experts_s"] if other else r_recv
    )
    proj = projection(rates, args.link_gbs * GB)
    log(
        "\nprojection, gpt-oss-120b, learner pp4 x ep8 (formula in the docstring), measured per GPU: "
        f"r_local {rates['local'] / GB:.1f}, r_dense {rates['dense'] / GB:.1f}, "
        f"r_recv {rates['recv'] / GB:.1f}"
        f"{'' if other else ' (one GPU: the gathered dst rate)'}, r_dst {r_recv / GB:.1f} GB/s; "
        f"r_net = min(rate, {args.link_gbs:g} GB/s)\n"
        "| GPUs | engine layout | GB received per GPU | GB kept local per GPU | seconds | target |\n"
        "|---|---|---|---|---|---|"
    )
    for p in proj:
        target = 2.0 if p["case"].startswith("(a)") else 10.0
        verdict = "<" if p["s"] < target else "MISS >="
        log(f"| {p['gpus']} | {p['case']} | {p['received'] / GB:.2f} | {p['local'] / GB:.2f} | "
            f"{p['s']:.2f} | {verdict} {target:g} s |")  # fmt: skip

    result = dict(
        device=name, gpus=world, layers=config.num_layers, vocab=config.vocab_size, model_gb=total / GB,
        gathered_s=t_b, local_s=t_a, r_recv_gbs=r_recv / GB, r_local_gbs=r_local / GB, per_rank=per_rank,
        fanout=fanout, rates_gbs={k: v / GB for k, v in rates.items()}, projection=proj,
    )  # fmt: skip
    if dims.rank == 0:
        print(json.dumps(result), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(result) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
