"""Per-GPU memory of training GPT-OSS under a layout: weights, gradients, optimizer state, activations.

    python tools/estimate_memory.py --model gpt_oss_120b --gpus 32 --tp 1 --pp 4 --ep 8
    python tools/estimate_memory.py --model gpt_oss_120b --search --gpus 16,32,64 --gpu-gib 80
    python tools/estimate_memory.py --model gpt_oss_120b --gpus 2 --ep 2 --cp 2 --tokens 131072 --recompute
    python tools/estimate_memory.py --model gpt_oss_120b --gpus 2 --ep 2 --cp 2 --tokens 131072 \
        --kv-exchange all_gather

What is counted, for the heaviest pipeline rank (the one with the most bytes):
    weights      this rank's parameters in the parameter dtype (bf16: 2 bytes)
    gradients    fp32 main gradients of every local parameter (4 bytes; `DistributedOptimizer`)
    optimizer    fp32 master weights and two Adam moments (12 bytes), divided over the dp x cp group (dense
                 parameters) and the edp group (experts) with the distributed optimizer
    activations  the tensors autograd saves, per token per layer (`activation_bytes_per_token`: the
                 layer's saved tensors on the CUDA path, its fused kernels: RMSNorm inputs, the attention
                 kernel's q, k, v, output and log-sum-exp, the routing, and per routed slot the expert
                 GEMMs' inputs and outputs), times the tokens of the micro-batches a rank
                 holds at once (1F1B: pp - rank; interleaved: Megatron's warm-up count); under context
                 parallelism a rank holds 1/cp of each micro-batch's tokens plus what the key/value
                 exchange adds (`context_parallel_bytes`, below)
    transient    the bf16 gradient of the largest parameter before it is added to its fp32 main gradient
Context parallelism (--cp, `context_parallel_bytes`): a micro-batch of N = --tokens tokens is cut into 2cp
chunks of c = N / 2cp tokens, 2c on each rank; keys and values bf16, Hkv / tp of the Hkv heads of D on a rank.
Beyond the 2c local tokens' activations:
    every layer  kept until its backward: the fp32 (O_r, LSE_r) of the local rows over their earlier keys,
                 which the LSE merge keeps, 2c x 4 (Hq D + Hq) / tp bytes (all 2c rows: one document
                 spanning the micro-batch)
    full-attention layers, ring (the default; also a window layer whose W - 1 exceeds c): nothing remote
                 kept (the backward passes the blocks around again); while one layer's backward runs, two
                 K/V blocks of 2c tokens (the one computed on and the next in flight, bf16) and two fp32
                 dK/dV accumulators of a block (the one added to and the one in flight):
                 2c x 2 Hkv D / tp x (2 x 2 + 2 x 4) bytes, counted once per rank (the forward holds the two
                 bf16 blocks only)
    full-attention layers, --kv-exchange all_gather: kept, the micro-batch's gathered keys and values,
                 N x 2 Hkv D / tp x 2 bytes; held in one layer's backward, their gradient (as much)
    sliding-window layers (W - 1 <= c): kept, every chunk's last W - 1 keys and values gathered (each
                 chunk reads its previous chunk's), 2cp x (W - 1) x 2 Hkv D / tp x 2 bytes
Not counted under cp: the merge's other fp32 temporaries (its weights and the diagonal output's copy).
Without an optimizer (forward + backward only) the gradients are the parameters' own bf16 `.grad`,
allocated layer by layer during the backward, and the total is the peak of that walk.
Not counted: the CUDA context and allocator fragmentation (reserved beyond allocated).

With --rollout-rows, the embedded engine's paged KV cache for that many rows of --rollout-tokens tokens
(prompt + response; the longest prompt --rollout-prompt-tokens) is printed too, as the engine sizes it
(`config.memory.kv_cache_bytes`, the same arithmetic the trainer uses to refuse a run that cannot fit):

    python tools/estimate_memory.py --model gpt_oss_20b --gpus 1 --rollout-rows 256 --rollout-tokens 2048
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass

from megatron_gptoss.config import MODEL_PRESETS, ModelConfig
from megatron_gptoss.config.memory import kv_cache_bytes

GIB = 1024**3


@dataclass(frozen=True)
class Layout:
    gpus: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    vpp: int = 1
    sequence_parallel: bool = False
    cp: int = 1  # context parallel: each micro-batch's tokens split over cp ranks

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp * self.cp)

    @property
    def edp(self) -> int:
        return self.dp * self.cp * self.tp // self.ep

    def valid(self, config: ModelConfig) -> bool:
        return (
            self.gpus % (self.tp * self.pp * self.cp) == 0
            and (self.dp * self.cp * self.tp) % self.ep == 0
            and config.num_query_groups % self.tp == 0
            and config.num_experts % self.ep == 0
            and config.num_layers >= self.pp * self.vpp
        )


def layer_params(config: ModelConfig, tp: int, ep: int) -> dict[str, int]:
    """Parameters of one transformer layer on one rank: dense (tp-sharded + replicated) and experts."""
    h, i, e, d = config.hidden_size, config.intermediate_size, config.num_experts, config.head_dim
    q, kv = config.num_attention_heads, config.num_query_groups
    qkv = (q + 2 * kv) * d
    sharded = h * qkv + qkv + q * d * h + q
    replicated = 3 * h + e * h + e
    experts = e * (2 * i * h + 2 * i + h * i + h)
    return {"dense": sharded // tp + replicated, "experts": experts // ep}


def activation_bytes_per_token(config: ModelConfig, tp: int = 1, sequence_parallel: bool = False) -> float:
    """Bytes autograd keeps per token per layer (bf16 activations, no recomputation) on the CUDA path, where
    the fused kernels run (tests/test_estimate_memory.py counts the layer's saved tensors against this):
        norms      each RMSNorm kernel's bf16 input and fp32 1/rms, and the router's bf16 input:
                   2 x (2h + 4) + 2h, in the residual stream's layout (1/tp of the tokens under sequence
                   parallelism)
        qkv input  the normalised input of the QKV product, 2h, whole on every tp rank (gathered under
                   sequence parallelism); the output projection's input is the attention output, below
        attention  the kernel's q and output (2 Hq D bytes each), k and v (2 Hkv D each) and fp32 LSE
                   (4 Hq); the rotary kernel's bf16 cos and sin (2 x D)
        routing    each token's top-k expert ids (int64) and probabilities (fp32): 12 k
        experts    per routed slot: the permuted input (2h), the fc1 output (gate and up, 2 x 2i), the fc2
                   input (2i) and output (2h), and the slot's row (int64): k (4h + 6i + 8)
    The attention, routing and expert terms are divided by tp."""
    h, i, d, k = config.hidden_size, config.intermediate_size, config.head_dim, config.moe_router_topk
    q, kv = config.num_attention_heads, config.num_query_groups
    stream = 2 * (2 * h + 4) + 2 * h
    qkv_input = 2 * h
    attention = 2 * 2 * q * d + 2 * 2 * kv * d + 4 * q + 2 * d
    routing = 12 * k
    experts = k * (4 * h + 6 * i + 8)
    return stream / (tp if sequence_parallel else 1) + qkv_input + (attention + routing + experts) / tp


KV_EXCHANGES = ("ring", "all_gather")


def context_parallel_bytes(
    config: ModelConfig, layout: Layout, tokens: int, kv_exchange: str = "ring"
) -> dict[str, float]:
    """Bytes that context parallelism adds on one rank for one micro-batch of `tokens` tokens (the module
    doc's formulas): per layer kind, what one layer keeps until its backward ('full' and 'window'; a
    window layer whose W - 1 exceeds a chunk counts as 'full': it goes around the ring), and 'exchange',
    what one layer's backward holds at once (counted once per rank). All zero when cp == 1."""
    if kv_exchange not in KV_EXCHANGES:
        raise ValueError(f"kv_exchange must be one of {KV_EXCHANGES}, got {kv_exchange!r}")
    if layout.cp == 1:
        return {"full": 0.0, "window": 0.0, "exchange": 0.0}
    if tokens % (2 * layout.cp):
        raise ValueError(f"--tokens {tokens} must be a multiple of 2 x cp = {2 * layout.cp}")
    c = tokens // (2 * layout.cp)
    kv = 2 * config.num_query_groups * config.head_dim / layout.tp  # K and V elements of one token
    rows = 2 * c * 4 * (config.num_attention_heads * config.head_dim + config.num_attention_heads) / layout.tp
    if kv_exchange == "ring":
        full, exchange = rows, 2 * c * kv * (2 * 2 + 2 * 4)  # two bf16 blocks, two fp32 accumulators
    else:
        full, exchange = rows + tokens * kv * 2, tokens * kv * 2  # the gathered K/V; their gradient
    span = config.sliding_window - 1
    window = full if span > c else rows + 2 * layout.cp * span * kv * 2
    if span <= c and all(config.window_of(n) is not None for n in range(config.num_layers)):
        exchange = 0.0  # no layer reaches past the previous chunk's tail
    return {"full": float(full), "window": float(window), "exchange": float(exchange)}


def stage_layers(config: ModelConfig, layout: Layout) -> list[int]:
    """Layers held by each pp rank (its virtual stages together), as `pipeline.split_layers` splits."""
    stages = layout.pp * layout.vpp
    base, extra = divmod(config.num_layers, stages)
    order = [*range(1, stages - 1), stages - 1, 0] if stages > 1 else [0]
    counts = [base + (s in set(order[:extra])) for s in range(stages)]
    return [sum(counts[s] for s in range(r, stages, layout.pp)) for r in range(layout.pp)]


def in_flight(layout: Layout, rank: int, micro_batches: int) -> float:
    """Micro-batches of activations (in units of the rank's whole layer set) held at once by pp `rank`."""
    if layout.pp == 1:
        return 1.0
    if layout.vpp == 1:
        return float(min(layout.pp - rank, micro_batches))
    chunks = (layout.pp - rank - 1) * 2 + (layout.vpp - 1) * layout.pp + 1
    return min(chunks, micro_batches * layout.vpp) / layout.vpp


def estimate(
    config: ModelConfig,
    layout: Layout,
    tokens: int,
    micro_batches: int = 1,
    distributed_optimizer: bool = True,
    optimizer: bool = True,
    activation_checkpointing: bool = False,
    param_bytes: int = 2,
    kv_exchange: str = "ring",
) -> dict[str, float]:
    """Bytes per component on the heaviest pp rank; `tokens` per micro-batch per data-parallel rank (a
    cp group's micro-batch: each of its ranks holds tokens / cp of them, and `context_parallel_bytes`
    more, its `exchange` counted in the activations).
    Without `optimizer`, gradients are the parameters' own (`.grad`, parameter dtype)."""
    per_layer = layer_params(config, layout.tp, layout.ep)
    vocab = config.padded_vocab_size(layout.tp) * config.hidden_size // layout.tp
    act_token = activation_bytes_per_token(config, layout.tp, layout.sequence_parallel)
    # a layer's bf16 input, in the residual stream's layout (1/tp of the tokens under sequence parallelism)
    kept_input = 2 * config.hidden_size / (layout.tp if layout.sequence_parallel else 1)
    cp_bytes = context_parallel_bytes(config, layout, tokens, kv_exchange)
    full = sum(config.window_of(n) is None for n in range(config.num_layers)) / config.num_layers
    cp_layer = full * cp_bytes["full"] + (1 - full) * cp_bytes["window"]  # kept, mean over the layers
    tokens_here = tokens // layout.cp
    worst: dict[str, float] = {}
    for rank, layers in enumerate(stage_layers(config, layout)):
        dense = layers * per_layer["dense"] + vocab * ((rank == 0) + (rank == layout.pp - 1))
        experts = layers * per_layer["experts"]
        params = dense + experts
        shards = (layout.dp * layout.cp, layout.edp) if distributed_optimizer else (1, 1)
        if activation_checkpointing:  # layer inputs kept; one layer recomputed at a time
            acts = kept_input * tokens_here * layers * in_flight(layout, rank, micro_batches)
            # the recomputed layer's first norm saves that same kept input: not counted twice
            acts += (act_token - kept_input) * tokens_here + cp_bytes["full" if full else "window"]
        else:
            kept = act_token * tokens_here + cp_layer
            acts = kept * layers * in_flight(layout, rank, micro_batches)
        acts += cp_bytes["exchange"] if layers else 0.0
        largest = max(per_layer["experts"] * 2 // 3, vocab) if layers else vocab
        parts = {
            "weights": params * param_bytes,
            "gradients": params * (4.0 if optimizer else param_bytes),
            "optimizer": 12.0 * (dense / shards[0] + experts / shards[1]) if optimizer else 0.0,
            "activations": acts,
            "transient": largest * 2.0,
        }
        parts["total"] = sum(parts.values())
        if not optimizer and layers:
            # gradients are allocated as the backward reaches each layer while the activations of the
            # layers before it are still held: the peak is the worst point of that walk, plus one
            # layer's backward workspace (about its activations)
            grad, act = parts["gradients"] / layers, parts["activations"] / layers
            walk = max(done * grad + (layers - done) * act for done in range(layers + 1))
            parts["total"] = parts["weights"] + walk + act
        if not worst or parts["total"] > worst["total"]:
            worst = parts
    return worst


def layouts(config: ModelConfig, gpus: int, cp_sizes: tuple[int, ...] = (1,)) -> list[Layout]:
    powers = [p for p in (1, 2, 4, 8, 16, 32, 64) if p <= gpus]
    out = []
    for tp, pp, ep, cp in itertools.product((1, 2, 4, 8), powers, powers, cp_sizes):
        layout = Layout(gpus, tp, pp, ep, sequence_parallel=tp > 1, cp=cp)
        if layout.valid(config) and tp <= 8:
            out.append(layout)
    return out


def _row(layout: Layout, parts: dict[str, float]) -> str:
    cells = " ".join(
        f"{parts[k] / GIB:9.1f}"
        for k in ("weights", "gradients", "optimizer", "activations", "transient", "total")
    )
    return (
        f"{layout.gpus:5d} {layout.tp:3d} {layout.cp:3d} {layout.pp:3d} {layout.ep:3d} {layout.dp:4d} {cells}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="gpt_oss_120b", choices=sorted(MODEL_PRESETS))
    parser.add_argument("--gpus", default="32", help="number of GPUs (a comma-separated list with --search)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--vpp", type=int, default=1)
    parser.add_argument(
        "--cp", default="1", help="context parallel size (a comma-separated list to try with --search)"
    )
    parser.add_argument(
        "--tokens",
        type=int,
        default=4096,
        help="tokens per micro-batch per data-parallel rank (split over the cp ranks)",
    )
    parser.add_argument(
        "--kv-exchange",
        default="ring",
        choices=KV_EXCHANGES,
        help="how full-attention layers reach earlier keys under cp > 1",
    )
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--recompute", action="store_true", help="activation checkpointing per layer")
    parser.add_argument("--search", action="store_true", help="list the layouts that fit")
    parser.add_argument("--gpu-gib", type=float, default=80.0)
    parser.add_argument("--headroom", type=float, default=0.9, help="usable fraction of the GPU memory")
    parser.add_argument("--rollout-rows", type=int, default=0, help="rows the engine generates at once")
    parser.add_argument("--rollout-tokens", type=int, default=2048, help="prompt + response tokens per row")
    parser.add_argument(
        "--rollout-prompt-tokens", type=int, default=512, help="the longest prompt (its first chunk)"
    )
    parser.add_argument("--engine-tp", type=int, default=1, help="the engine's tensor parallel size")
    parser.add_argument("--kv-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--block-size", type=int, default=16, help="embedded.block_size")
    parser.add_argument("--max-step-tokens", type=int, default=2048, help="embedded.max_step_tokens")
    args = parser.parse_args()
    config = MODEL_PRESETS[args.model]()
    print(
        f"{args.model}: {config.param_counts()['total'] / 1e9:.1f}B parameters; GiB per GPU (heaviest rank)"
    )
    if args.rollout_rows:
        cache = kv_cache_bytes(
            config,
            args.rollout_rows,
            args.rollout_tokens,
            dtype_bytes=2 if args.kv_dtype == "bfloat16" else 4,
            block_size=args.block_size,
            max_step_tokens=args.max_step_tokens,
            prompt_tokens=args.rollout_prompt_tokens,
        )
        print(
            f"engine KV cache: {cache / args.engine_tp / GIB:.2f} GiB per engine rank (tp {args.engine_tp}) "
            f"for {args.rollout_rows} rows of {args.rollout_tokens} tokens, prompts of up to "
            f"{args.rollout_prompt_tokens} ({args.kv_dtype})"
        )
    print(" gpus  tp  cp  pp  ep   dp   weights gradients optimizer activations transient   total")
    cp_sizes = tuple(int(c) for c in args.cp.split(","))

    def estimate_of(layout: Layout) -> dict[str, float]:
        return estimate(
            config,
            layout,
            args.tokens,
            args.micro_batches,
            activation_checkpointing=args.recompute,
            kv_exchange=args.kv_exchange,
        )

    if not args.search:
        layout = Layout(
            int(args.gpus), args.tp, args.pp, args.ep, args.vpp, sequence_parallel=args.tp > 1, cp=cp_sizes[0]
        )
        if not layout.valid(config):
            raise SystemExit(f"{layout} does not divide {args.model}")
        print(_row(layout, estimate_of(layout)))
        return
    budget = args.gpu_gib * args.headroom * GIB
    for gpus in (int(g) for g in args.gpus.split(",")):
        fits = []
        for layout in layouts(config, gpus, cp_sizes):
            parts = estimate_of(layout)
            if parts["total"] <= budget:
                fits.append((parts["total"], layout, parts))
        print(f"-- {gpus} GPUs: {len(fits)} layouts fit in {args.headroom:.0%} of {args.gpu_gib:.0f} GiB")
        for _, layout, parts in sorted(fits, key=lambda f: (f[1].tp * f[1].pp, f[0]))[:8]:
            print(_row(layout, parts))


if __name__ == "__main__":
    main()
