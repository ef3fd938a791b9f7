"""Rollout benchmark of the embedded engine: gpt-oss-20b at full size on one GPU, continuous batching against
the static schedule, decode steps against the HBM roofline.

    python benchmarks/bench_rollout.py                     # check + decode + prefill (one call, < 10 min)
    python benchmarks/bench_rollout.py --part workload --slots 64  # the long-tailed workload, both schedules
    python benchmarks/bench_rollout.py --part slice        # 4 layers at gpt-oss-120b width
    python benchmarks/bench_rollout.py --tiny              # every part at toy size, on the CPU if no GPU

Weights: random, written once as a synthetic checkpoint in the released layout (expert weights MXFP4
`_blocks` / `_scales` with random codes and a fixed scale, everything else bf16; --ckpt, reused when
present) and loaded through `hf.io.iter_checkpoint`, dequantized to bf16. One engine is in memory at a time;
`EmbeddedEngine.reconfigure` switches the schedule and batch slots without reloading.

Parts:
    check     a small fp32 model on the same device: continuous (3 slots, chunked prefill, decode graphs on a
              GPU), static, and continuous with eager decode steps give the same tokens, log-probs within
              1e-5 of each other; on a GPU also bf16 decode steps replayed from CUDA graphs against the same
              bucketed steps run eagerly (tokens equal, log-probs within 1e-6); fails the run otherwise
    decode    per --slots B and per --experts path (the decode expert kernels, or the library's grouped
              GEMM as the baseline), decode steps eager and (GPU) from CUDA graphs: B prompts of --prompt-len
              tokens prefilled --decode-chunk tokens a step, then at least --decode-steps steps decoding all
              B rows (no stop): the median time of such a step, against the roofline time = (bytes of the
              weights read by that step + bytes of the KV read) / bandwidth, for the spec bandwidth of the GPU
              (H100 SXM 3.35 TB/s, H200 4.8 TB/s) and a measured device copy rate (2 x bytes / time of a
              1 GiB copy). Weights read: every non-expert weight and the output layer once, and of each
              layer's experts those hit, E (1 - (1 - k / E)^B) in expectation for uniform routing
    prefill   B prompts of --prompt-len, one new token: model FLOPs (2 x active parameters per token, and
              4 x heads x head_dim per visible query-key pair) over the time of the prefill steps
    workload  per --slots B: 4 B prompts (--prompts-per-slot) of --prompt-len tokens, response lengths drawn
              from a log-normal (median --median-response, sigma --sigma) clipped to [16, --max-response]
              and given to each row as its budget (no stop token): tokens/s and peak memory of the
              continuous schedule with decode graphs, then of the static one with eager decode steps
              (batches of B prompts run to their longest row: the engine before continuous batching and
              graphs); out of memory is reported as such. Each run is timed after an untimed one of the
              same prompts with responses of at most --warmup-response tokens (kernels compiled for the
              run's shapes), the cache released between them
    slice     decode of a 4-layer gpt-oss-120b-width model (128 experts, top-4), random weights drawn on the
              device, per --slots

--lora-rank R gives the engine's model rank-R adapters on the gpt-oss-20b LoRA recipe's targets (QKV,
attention output, every expert's fc1 / fc2; alpha 2R), their A and B drawn from Normal(0, 0.02), as the
engine of a LoRA run holds them beside the shared frozen base; the roofline then adds every adapter's bytes
(all of them read each step).

--expert-format bf16,mxfp4 runs the decode part (and the prefill part) once per format, one engine in memory
at a time: bf16 holds the experts dequantized (as above); mxfp4 holds the checkpoint's MXFP4 bytes as they are
(`model.expert_format: mxfp4`, the engine's MXFP4 expert GEMMs), every other weight the same; mxfp4-pairs
the same bytes re-encoded for the kernels (`model.mxfp4_byte_format: pairs`), mxfp4-tiled the pairs stored
tile by tile (`tiled_pairs`). Each row's roofline counts
the bytes that format reads: 4.25 bits per MXFP4 expert value (a 4-bit code and a shared 8-bit scale per 32
values).

Prints one markdown table per part; --json appends every result as a JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import statistics
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_gptoss.config import EmbeddedEngineConfig, ModelConfig, gpt_oss_20b, gpt_oss_120b
from megatron_gptoss.config.lora import LoRAConfig
from megatron_gptoss.engine_api.protocol import SamplingParams
from megatron_gptoss.hf.convert import iter_hf_tensors
from megatron_gptoss.hf.io import iter_checkpoint, weight_map_of
from megatron_gptoss.hf.mxfp4 import SCALE_BIAS, packed_shapes
from megatron_gptoss.hf.names import fc1_rows_from_hf, hf_names, hf_shapes, match_hf, match_ours
from megatron_gptoss.model import build_model
from megatron_gptoss.model.lora import base_config, is_adapter_param
from megatron_gptoss.model.mxfp4_weight import mxfp4_weights
from megatron_gptoss.ops import batch_invariant, moe_decode
from megatron_gptoss.rollout.embedded import EmbeddedEngine

SPEC_BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12}


class TimedEngine(EmbeddedEngine):
    """The engine with each step timed (a device sync around it): (seconds, decode rows, prefill tokens,
    keys read by the decode rows). With `decode_ahead` no sync: a step returns once its tokens are back,
    while the next one, launched ahead, runs; the time between returns is the device's step."""

    log: list[tuple[float, int, int, int]]

    def _step(self, ahead: bool = True):
        if not self.options.decode_ahead:
            sync(self.device)
        start = time.perf_counter()
        plan = super()._step(ahead)
        if not self.options.decode_ahead:
            sync(self.device)
        decode = [c for c in plan.chunks if c.count == 1]
        prefill = sum(c.count for c in plan.chunks if c.count > 1)
        self.log.append((time.perf_counter() - start, len(decode), prefill, sum(c.start + 1 for c in decode)))
        return plan


# --expert-format: the model fields each format sets
FORMATS = {
    "bf16": {"expert_format": "bf16"},
    "mxfp4": {"expert_format": "mxfp4", "mxfp4_byte_format": "checkpoint"},
    "mxfp4-pairs": {"expert_format": "mxfp4", "mxfp4_byte_format": "pairs"},
    "mxfp4-tiled": {"expert_format": "mxfp4", "mxfp4_byte_format": "tiled_pairs"},
}


def format_name(config) -> str:
    """The --expert-format name of how `config` holds its experts."""
    fields = {name: getattr(config, name) for name in ("expert_format", "mxfp4_byte_format")}
    for name, held in FORMATS.items():
        if held.items() <= fields.items():
            return name
    raise ValueError(f"no --expert-format holds experts as {fields}")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def tiny_config(**overrides) -> ModelConfig:
    base = dict(
        vocab_size=512, hidden_size=64, intermediate_size=64, num_layers=4, num_attention_heads=4,
        num_query_groups=2, head_dim=16, sliding_window=16, num_experts=8, moe_router_topk=2,
        make_vocab_size_divisible_by=128, attention_backend="eager",
    )  # fmt: skip
    return gpt_oss_20b(**{**base, **overrides})


# ------------------------------------------------------------------------------------------------ weights
def write_synthetic_mxfp4(config: ModelConfig, path: Path, seed: int = 0) -> Path:
    """A checkpoint directory in the released layout with random weights, one shard per layer (reused if
    `path` holds one already)."""
    if (path / "config.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for name in hf_names(config):
        match = match_hf(name)
        assert match is not None
        shape = hf_shapes(match, config)[match.hf.index(name)]
        layer = name.split(".")[2] if name.startswith("model.layers.") else "other"
        shard = shards.setdefault(f"model-{layer}.safetensors", {})
        packed = packed_shapes(shape) if name.endswith(("gate_up_proj", "down_proj")) else None
        if packed is not None:  # random FP4 codes; a scale of 2^-7 gives values of about 0.02
            shard[name + "_blocks"] = torch.randint(0, 256, packed[0], generator=gen, dtype=torch.uint8)
            shard[name + "_scales"] = torch.full(packed[1], SCALE_BIAS - 7, dtype=torch.uint8)
        elif "norm" in name:
            shard[name] = torch.ones(shape, dtype=torch.bfloat16)
        elif name.endswith("bias"):
            shard[name] = torch.zeros(shape, dtype=torch.bfloat16)
        else:
            shard[name] = (0.02 * torch.randn(shape, generator=gen)).to(torch.bfloat16)
    weight_map = {}
    for file, tensors in shards.items():
        save_file(tensors, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    hf = config.to_hf_config()
    hf["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn"],
    }
    (path / "config.json").write_text(json.dumps(hf))
    return path


def engine_options(
    args,
    slots: int,
    schedule: str = "continuous",
    new: int | None = None,
    graphs: str = "auto",
    chunk: int | None = None,
    admit_batch: int = 0,
    graph_tokens: int = 2048,
):
    """Options for `slots` rows of --prompt-len tokens and `new` new tokens at most (default
    --decode-steps): a fixed cache of exactly what they need; a step holds every decoding row plus `chunk`
    prefill tokens (default --step-tokens), so prefill advances however many rows decode."""
    longest = args.prompt_len + (args.decode_steps if new is None else new)
    return EmbeddedEngineConfig(
        schedule=schedule,
        max_batch_slots=slots,
        block_size=args.block_size,
        max_step_tokens=slots + (args.step_tokens if chunk is None else chunk),
        kv_blocks=slots * math.ceil(longest / args.block_size) + 1,
        cuda_graphs=graphs,
        admit_batch=admit_batch,
        cuda_graph_max_tokens=graph_tokens,
        decode_ahead=args.decode_ahead == "on",
    )


def graph_modes(device: torch.device) -> list[str]:
    """Decode graph modes to compare: eager ("off") and, on a GPU, captured graphs ("auto")."""
    return ["off", "auto"] if device.type == "cuda" else ["off"]


def graphs_used(engine: EmbeddedEngine) -> str:
    """How the last request's decode steps ran: "captured", or "eager" (and why, where graphs were off)."""
    graphs = engine._graphs
    if graphs is None:
        return "eager"
    if graphs.failure is not None:
        return f"eager, not captured ({graphs.failure[:60]})"
    return "captured" if any(b.graph is not None for b in graphs._buffers.values()) else "eager"


# ------------------------------------------------------------------------------------------------ roofline
MXFP4_BYTES_PER_VALUE = 4.25 / 8  # a 4-bit code, and an 8-bit scale shared by 32 values


def decode_bytes(config: ModelConfig, batch: int, keys_read: int, weight_bytes: int, kv_bytes: int) -> float:
    """Bytes one decode step of `batch` rows reads: weights (experts hit in expectation) + KV. The experts'
    fc1 / fc2 matrices count `MXFP4_BYTES_PER_VALUE` a value when `config.expert_format` is mxfp4, else
    `weight_bytes`; their biases `weight_bytes`."""
    h, i, e, k = config.hidden_size, config.intermediate_size, config.num_experts, config.moe_router_topk
    d, hq, hkv = config.head_dim, config.num_attention_heads, config.num_query_groups
    attention = h * (hq + 2 * hkv) * d + hq * d * h + 4 * h  # qkv, o_proj, norms and biases (about)
    matrix = MXFP4_BYTES_PER_VALUE if config.expert_format == "mxfp4" else weight_bytes
    expert = 3 * h * i * matrix + (2 * i + h) * weight_bytes
    hit = e * (1 - (1 - k / e) ** batch)
    dense = config.num_layers * (attention + e * h) + config.vocab_size * h
    kv = keys_read * hkv * d * 2  # k and v, per key and layer, at the cache dtype
    return dense * weight_bytes + config.num_layers * hit * expert + kv * kv_bytes


def keys_per_step(config: ModelConfig, contexts: list[int]) -> int:
    """Keys (per layer summed) the decode rows of one step read: full layers their context, sliding ones
    their window."""
    full = sum(1 for t in config.layer_types if t != "sliding")
    sliding = config.num_layers - full
    return sum(full * c + sliding * min(c, config.sliding_window) for c in contexts)


def measured_bandwidth(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    src = torch.empty(1 << 29, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    sync(device)
    return 2 * src.numel() * src.element_size() * 10 / (time.perf_counter() - start)


def spec_bandwidth(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((bw for key, bw in SPEC_BANDWIDTH.items() if key in name), None)


def prefill_flops(config: ModelConfig, prompt_len: int) -> float:
    active = config.param_counts()["active"]
    d, hq, w = config.head_dim, config.num_attention_heads, config.sliding_window
    pairs = 0
    for kind in config.layer_types:
        pairs += sum(min(j + 1, w) if kind == "sliding" else j + 1 for j in range(prompt_len))
    return 2 * active * prompt_len + 4 * hq * d * pairs


# ------------------------------------------------------------------------------------------------ parts
def prompts_of(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (count, length), generator=gen).tolist()


def part_check(args, device) -> list[dict]:
    config = tiny_config(attention_backend="auto" if device.type == "cuda" else "eager")  # GPU: its kernels
    model = build_model(config, seed=1).to(device)
    engine = EmbeddedEngine(config, torch.float32, device)
    engine.update_weights(iter_hf_tensors(model, config))
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 512, (int(n),), generator=gen).tolist() for n in torch.randint(1, 40, (12,))]
    budgets = torch.randint(1, 30, (12,), generator=gen).tolist()
    params = SamplingParams(temperature=0.9, seed=7)
    results, ran = {}, "eager"
    # continuous (decode graphs on a GPU), static, and continuous with every decode step eager
    for name, schedule, slots, graphs in (
        ("continuous", "continuous", 3, "auto"),
        ("static", "static", 4, "auto"),
        ("eager", "continuous", 3, "off"),
    ):
        engine.reconfigure(EmbeddedEngineConfig(schedule=schedule, max_batch_slots=slots, block_size=8,
                                                max_step_tokens=16, cuda_graphs=graphs))  # fmt: skip
        results[name] = engine.generate(prompts, params, max_new_tokens=budgets)
        ran = graphs_used(engine) if name == "continuous" else ran
    ref = results["continuous"]
    same = all(a.token_ids == b.token_ids for other in results.values() for a, b in zip(ref, other))
    worst = max(
        max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs))
        for other in results.values()
        for a, b in zip(ref, other)
    )
    row = {"part": "check", "dtype": "float32", "continuous_ran": ran, "tokens_equal": same,
           "max_logprob_delta": worst}  # fmt: skip
    if not same or worst > 1e-5:
        raise SystemExit(f"continuous, static and eager-decode runs disagree: {row}")
    return [row] + (
        [check_graphs(model, config, prompts, budgets, params, device)] if device.type == "cuda" else []
    )


def check_graphs(model, config: ModelConfig, prompts, budgets, params: SamplingParams, device) -> dict:
    """bf16 (where the decode step is captured): decode steps replayed from CUDA graphs give the tokens and
    log-probs of the same bucketed buffers run eagerly ("padded"); fails the run otherwise."""
    engine = EmbeddedEngine(config, torch.bfloat16, device)
    engine.update_weights(iter_hf_tensors(model, config))
    results, ran = {}, "eager"
    for graphs in ("auto", "padded"):
        engine.reconfigure(EmbeddedEngineConfig(max_batch_slots=3, block_size=8, max_step_tokens=16,
                                                cuda_graphs=graphs))  # fmt: skip
        results[graphs] = engine.generate(prompts, params, max_new_tokens=budgets)
        ran = graphs_used(engine) if graphs == "auto" else ran
    pairs = list(zip(results["auto"], results["padded"]))
    same = all(a.token_ids == b.token_ids for a, b in pairs)
    worst = max(max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) for a, b in pairs)
    row = {"part": "check", "dtype": "bfloat16", "continuous_ran": ran, "tokens_equal": same,
           "max_logprob_delta": worst}  # fmt: skip
    if ran != "captured" or not same or worst > 1e-6:
        raise SystemExit(f"decode graphs and the eager bucketed step disagree (or no capture): {row}")
    return row


def part_decode(args, engine: TimedEngine, config: ModelConfig, device) -> list[dict]:
    """Continuous batching prefills the prompts --decode-chunk tokens a step while the rows prefilled first
    already decode; every row's budget covers those prefill steps plus --decode-steps, so the last
    --decode-steps steps (at least) decode all rows and nothing else: those are the measured steps."""
    rows = []
    spec, copy = spec_bandwidth(device), measured_bandwidth(device)
    size = engine.dtype.itemsize
    for slots in args.slots:
        prefill_steps = math.ceil(slots * args.prompt_len / args.decode_chunk)
        new = args.decode_steps + prefill_steps
        prompts = prompts_of(slots, args.prompt_len, config.vocab_size, seed=slots)
        for experts in args.experts:
            for graphs in graph_modes(device):
                engine.reconfigure(
                    engine_options(args, slots, new=new, graphs=graphs, chunk=args.decode_chunk)
                )
                engine.log = []
                head = {"part": "decode", "format": format_name(config), "slots": slots, "experts": experts,
                        "graphs": graphs}  # fmt: skip
                library = moe_decode.library_only() if experts == "library" else contextlib.nullcontext()
                try:
                    with library:
                        engine.generate(prompts, SamplingParams(seed=1), max_new_tokens=[new] * slots)
                except torch.cuda.OutOfMemoryError:
                    rows.append({**head, "status": "out of memory"})
                    continue
                rows.append({**head, **decode_row(engine, config, slots, spec, copy, size)})
    return rows


def decode_row(engine: TimedEngine, config: ModelConfig, slots: int, spec, copy, size: int) -> dict:
    """The median decode-only step of all `slots` rows in the engine's log, against the roofline."""
    full = [(t, keys) for t, n, p, keys in engine.log if n == slots and p == 0]
    if not full:
        return {"status": f"no decode-only step of {slots} rows in {len(engine.log)} steps"}
    step = statistics.median(t for t, _ in full)
    keys = statistics.median(k for _, k in full)
    contexts = [int(keys // slots)] * slots
    nbytes = decode_bytes(config, slots, keys_per_step(config, contexts), size, size)
    nbytes += sum(
        p.numel() * p.element_size() for n, p in engine.model.named_parameters() if is_adapter_param(n)
    )
    return {
        "ran": graphs_used(engine), "lora_rank": config.lora.rank, "steps": len(full), "context": contexts[0],
        "step_ms": 1e3 * step,
        "tokens_per_s": slots / step, "gbytes_read": nbytes / 1e9,
        "roofline_ms_spec": None if spec is None else 1e3 * nbytes / spec,
        "roofline_ms_copy": None if copy is None else 1e3 * nbytes / copy,
        "x_roofline_spec": None if spec is None else step / (nbytes / spec),
        "x_roofline_copy": None if copy is None else step / (nbytes / copy),
    }  # fmt: skip


def part_prefill(args, engine: TimedEngine, config: ModelConfig, device) -> list[dict]:
    slots = args.slots[0]
    engine.reconfigure(engine_options(args, slots))
    engine.log = []
    engine.generate(
        prompts_of(slots, args.prompt_len, config.vocab_size, 3), SamplingParams(max_new_tokens=1)
    )
    seconds = sum(t for t, n, p, _ in engine.log if p)
    flops = slots * prefill_flops(config, args.prompt_len)
    row = {"part": "prefill", "format": format_name(config), "prompts": slots, "prompt_len": args.prompt_len}
    return [{**row, "seconds": seconds, "tflops": flops / seconds / 1e12}]


def response_lengths(args, count: int) -> list[int]:
    gen = torch.Generator().manual_seed(11)
    draws = torch.exp(math.log(args.median_response) + args.sigma * torch.randn(count, generator=gen))
    return draws.round().clamp(16, args.max_response).long().tolist()


def part_workload(args, engine: TimedEngine, config: ModelConfig, device) -> list[dict]:
    rows = []
    for slots in args.slots:
        count = args.prompts_per_slot * slots
        prompts = prompts_of(count, args.prompt_len, config.vocab_size, seed=5)
        budgets = response_lengths(args, count)
        # default: after = continuous batching with decode graphs; before = the static schedule, decode eager
        runs = [run.split(":") for run in args.runs.split(",")]
        settings = [(run, a, g) for run in runs for a in args.admit_batch for g in args.graph_tokens]
        for (schedule, graphs), admit, graph_tokens in settings:
            options = engine_options(args, slots, schedule, max(budgets), graphs, None, admit, graph_tokens)
            engine.reconfigure(options)
            row = {"part": "workload", "format": format_name(config), "slots": slots, "schedule": schedule,
                   "graphs": graphs, "admit_batch": engine.options.admit_slots(),
                   "graph_tokens": graph_tokens, "warmup_response": args.warmup_response, "prompts": count,
                   "response_mean": statistics.mean(budgets), "response_max": max(budgets)}  # fmt: skip
            try:
                if args.warmup_response:  # the timed run's kernels compiled, its buckets captured once
                    short = [min(b, args.warmup_response) for b in budgets]
                    engine.generate(prompts, SamplingParams(seed=4), max_new_tokens=short)
                    engine.reconfigure(options)  # the cache sized for the timed run, as without a warm-up
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(device)
                engine.log = []
                start = time.perf_counter()
                outs = engine.generate(prompts, SamplingParams(seed=3), max_new_tokens=budgets)
                seconds = time.perf_counter() - start
            except torch.cuda.OutOfMemoryError:
                rows.append({**row, "status": "out of memory"})
                continue
            tokens = sum(len(o.token_ids) for o in outs)
            peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
            mixed = [t for t, _, p, _ in engine.log if p]  # steps that prefilled (beside decoding rows)
            done = {"ran": graphs_used(engine), "seconds": seconds, "tokens_per_s": tokens / seconds,
                    "steps": len(engine.log), "prefill_steps": len(mixed), "prefill_s": sum(mixed),
                    "decode_step_ms": 1e3 * (sum(t for t, *_ in engine.log) - sum(mixed))
                    / max(1, len(engine.log) - len(mixed))}  # fmt: skip
            rows.append({**row, **done, "peak_gib": peak})
    return rows


def print_table(rows: list[dict]) -> None:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        cells = [f"{v:.4g}" if isinstance(v, float) else str(v) for v in (r.get(k, "") for k in keys)]
        print("| " + " | ".join(cells) + " |")
    print()


def random_weights(engine: EmbeddedEngine, seed: int = 0) -> None:
    """Normal(0, 0.02) matrices and sinks, unit norms, zero biases, drawn on the engine's device (no host copy
    of the model: the 120b-width slice has 12.7B parameters)."""
    gen = torch.Generator(device=engine.device).manual_seed(seed)
    with torch.no_grad():
        for name, p in engine.model.named_parameters():
            if name.endswith(("layer_norm_weight", "layernorm.weight")):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen, device=p.device).mul_(0.02))
    engine.memory.weights_loaded()


def random_adapters(engine: EmbeddedEngine, seed: int = 1) -> None:
    """Every adapter's A and B from Normal(0, 0.02), drawn on the engine's device (B is not zero, so the
    adapters change the outputs as a trained run's do)."""
    gen = torch.Generator(device=engine.device).manual_seed(seed)
    with torch.no_grad():
        for name, p in engine.model.named_parameters():
            if is_adapter_param(name):
                p.copy_(torch.randn(p.shape, generator=gen, device=p.device).mul_(0.02))
    engine.memory.weights_loaded()


def with_adapters(config: ModelConfig, rank: int) -> ModelConfig:
    """config with rank-`rank` adapters on the gpt-oss-20b LoRA recipe's targets (none for rank 0)."""
    if rank == 0:
        return config
    return dataclasses.replace(config, lora=LoRAConfig(rank=rank, alpha=2.0 * rank))


def load_mxfp4_bytes(engine: EmbeddedEngine, checkpoint: Path) -> None:
    """Fill the engine's MXFP4 expert weights with the checkpoint's `<name>_blocks` / `<name>_scales` bytes as
    they are (fc1's rows from HF's interleaved gate/up to our [gate; up])."""
    files = weight_map_of(checkpoint)
    for name, weight in mxfp4_weights(engine.model).items():
        match = match_ours(name)
        hf_name = match.hf[0]
        packed = []
        for part in ("_blocks", "_scales"):
            with safe_open(str(checkpoint / files[hf_name + part]), framework="pt") as f:
                t = f.get_tensor(hf_name + part)
            packed.append(fc1_rows_from_hf(t) if match.rule.kind == "fc1" else t)
        weight.copy_packed_(packed[0].to(weight.device), packed[1].to(weight.device))


def build_engine(config: ModelConfig, args, device, checkpoint: Path | None) -> TimedEngine:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    engine = TimedEngine(config, dtype, device, options=engine_options(args, args.slots[0]))
    engine.log = []
    if checkpoint is not None and config.expert_format == "mxfp4":
        experts = ("gate_up_proj", "down_proj")  # their matrices arrive as bytes below, biases here
        dense = ((n, t) for n, t in iter_checkpoint(checkpoint, config, dtype) if not n.endswith(experts))
        engine.update_weights(dense, strict=False)
        load_mxfp4_bytes(engine, checkpoint)
    elif checkpoint is not None:
        engine.update_weights(iter_checkpoint(checkpoint, config, dtype), strict=not config.lora.enabled)
    else:
        random_weights(engine)
    if config.lora.enabled:
        random_adapters(engine)
    engine.reconfigure(engine_options(args, 2, new=4))  # warm-up: kernels compiled, decode graphs captured
    engine.generate([[1] * args.prompt_len, [2] * 3], SamplingParams(max_new_tokens=4))
    return engine


def int_list(text: str) -> list[int]:
    """A comma-separated list of integers (a command-line value)."""
    return [int(x) for x in text.split(",")]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--part", default="default", choices=["default", "check", "decode", "prefill",
                                                               "workload", "slice", "all"])  # fmt: skip
    parser.add_argument("--slots", type=int_list, default=None)
    parser.add_argument("--tiny", action="store_true", help="toy sizes (a CPU smoke run)")
    parser.add_argument("--ckpt", type=Path, default=Path("/tmp/bench_rollout_ckpt"))
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--decode-steps", type=int, default=None)
    parser.add_argument("--prompts-per-slot", type=int, default=4)
    parser.add_argument("--median-response", type=int, default=None)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--max-response", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--step-tokens", type=int, default=512, help="prefill tokens per step (beside decode rows)"
    )
    parser.add_argument(
        "--decode-chunk", type=int, default=4096, help="prefill tokens per step of the decode part"
    )
    parser.add_argument(
        "--runs", default="continuous:auto,static:off", help="workload: schedule:cuda_graphs, in order"
    )
    parser.add_argument(
        "--admit-batch",
        type=int_list,
        default=[0],
        help="workload: embedded.admit_batch values, comma-separated, each run with every one (0: the "
        "engine's default)",
    )
    parser.add_argument(
        "--graph-tokens",
        type=int_list,
        default=[2048],
        help="workload: embedded.cuda_graph_max_tokens values, comma-separated, each run with every one (0: "
        "steps with prefill tokens run eagerly)",
    )
    parser.add_argument(
        "--warmup-response",
        type=int,
        default=32,
        help="workload: before each timed run the same prompts with responses of at most this many tokens, "
        "untimed, then the cache released: the timed run's kernels are compiled and its graph buckets "
        "captured once before (it captures them again, as a step after a sleep does; 0: none)",
    )
    parser.add_argument(
        "--decode-ahead",
        choices=["on", "off"],
        default="on",
        help="embedded.decode_ahead: replayed decode steps launch the next one before their tokens are read",
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--bitwise", action="store_true", help="the batch-invariant kernels (rollout.bitwise_on_policy)"
    )
    parser.add_argument(
        "--experts",
        type=lambda s: s.split(","),
        default=["decode"],
        help="decode part: the engine's expert GEMMs, comma-separated: decode (the decode kernels of "
        "ops.moe_decode where eligible), library (grouped GEMM)",
    )
    parser.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="decode, prefill and workload parts: adapters of this rank in the engine (0: none)",
    )
    parser.add_argument(
        "--expert-format",
        type=lambda s: s.split(","),
        default=["bf16"],
        help="decode, prefill and workload parts: how the engine holds the experts, comma-separated: bf16 "
        "(dequantized), mxfp4 (the checkpoint's 4-bit bytes), mxfp4-pairs (re-encoded for the kernels), "
        "mxfp4-tiled (the pairs tile by tile); one "
        "engine per format, in order",
    )
    args = parser.parse_args(argv)
    if not set(args.experts) <= {"decode", "library"}:
        parser.error(f"--experts takes decode and library, got {args.experts}")
    if not set(args.expert_format) <= set(FORMATS):
        parser.error(f"--expert-format takes {', '.join(FORMATS)}, got {args.expert_format}")
    with batch_invariant.enabled(args.bitwise):
        return _run(args)


def _run(args) -> list[dict]:
    small = dict(slots=[2, 4], prompt_len=12, decode_steps=6, median_response=8, max_response=40)
    large = dict(
        slots=[64, 256, 512], prompt_len=512, decode_steps=64, median_response=256, max_response=2048
    )
    for key, value in (small if args.tiny else large).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    parts = {
        "default": ["check", "decode", "prefill"],
        "all": ["check", "decode", "prefill", "workload", "slice"],
    }
    engine_parts = {"decode": part_decode, "prefill": part_prefill, "workload": part_workload}
    rows: list[dict] = []
    engine = None  # the gpt-oss-20b engine, loaded once for decode, prefill and workload
    for part in parts.get(args.part, [args.part]):
        if part == "check":
            rows += part_check(args, device)
        elif part == "slice":
            config = (
                gpt_oss_120b(num_layers=4)
                if not args.tiny
                else tiny_config(num_experts=16, moe_router_topk=4)
            )
            engine = None  # one engine in memory at a time
            sliced = build_engine(config, args, device, None)
            rows += [{**r, "part": "slice"} for r in part_decode(args, sliced, config, device)]
            del sliced
        elif part in ("decode", "prefill", "workload") and (args.expert_format != ["bf16"] or args.lora_rank):
            config = with_adapters(tiny_config() if args.tiny else gpt_oss_20b(), args.lora_rank)
            # the checkpoint holds the base alone
            path = write_synthetic_mxfp4(
                base_config(config), args.ckpt / ("tiny" if args.tiny else "gpt-oss-20b")
            )
            engine = None  # one engine in memory at a time
            for expert_format in args.expert_format:
                held = dataclasses.replace(config, **FORMATS[expert_format])
                formatted = build_engine(held, args, device, path)
                rows += engine_parts[part](args, formatted, held, device)
                del formatted
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        else:
            config = tiny_config() if args.tiny else gpt_oss_20b()
            if engine is None:
                path = args.ckpt / ("tiny" if args.tiny else "gpt-oss-20b")
                engine = build_engine(config, args, device, write_synthetic_mxfp4(config, path))
            rows += engine_parts[part](args, engine, config, device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for part in dict.fromkeys(r["part"] for r in rows):
        mode = ", batch-invariant kernels" if args.bitwise else ""
        print(f"## {part} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}{mode})")
        print_table([r for r in rows if r["part"] == part])
    if args.json is not None:
        with args.json.open("a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return rows


if __name__ == "__main__":
    main()
