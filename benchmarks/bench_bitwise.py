"""Engine-vs-learner fidelity of a GPT-OSS MoE in bf16 on one GPU: router replay and bitwise on-policy mode.

    python benchmarks/bench_bitwise.py                         # 2 layers at gpt-oss-120b width, 256 rows
    python benchmarks/bench_bitwise.py --tiny                  # toy size (on the CPU without a GPU)

The embedded engine generates --rows responses (prompts of --prompt-len random tokens, --new-tokens sampled
at temperature 1, no stop); the learner then computes the log-probs of the same tokens in its packed training
forward (--pack sequences per forward). Per setting, one table row:
    none      engine and learner with the library kernels
    r3        the engine records each token's experts, the learner's forward replays them
    bitwise   both sides with the batch-invariant kernels (`rollout.bitwise_on_policy`)
these three with the engine's decode steps eager; then with its decode steps from CUDA graphs (on a GPU):
r3 (the recorded experts out of the graphs' static buffers), none, bitwise, and none again. Each with the
mean and max |engine log-prob - learner log-prob| over the sampled tokens, the fraction of (token, layer)
pairs whose top-k experts differ between engine and learner (r3: before replay), the
engine's generation time and the learner's forward time. r2 (the update replays the old-policy pass's
experts) compares two learner passes: the row `r2 (learner)` is the learner's forward with its sequences
packed --pack at a time against one sequence at a time, without and with the first pass's experts replayed.

Random weights at the usual scale route almost uniformly and give flat logits that hide mismatch; the router
and the output layer are drawn --router-std / --output-std (and the rest --std): the mean entropy of the
router's softmax over all experts and of the output distribution are printed beside the table.

Then the mode's cost (--cost-tokens, 0 skips it): the learner's forward + backward of the training block of
`benchmarks/bench_train.py` (the same layers, a --cost-vocab output layer: 2,048 as there, where the head is
small beside the layers; documents of --doc-len tokens packed into one micro-batch, token-mean log-prob loss,
every parameter trained) with the library kernels and in the batch-invariant mode, alternating, the median
of --iters each after a warm-up, and their ratio (the goal: at most 1.15).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from megatron_gptoss.config import EmbeddedEngineConfig, gpt_oss_120b, gpt_oss_tiny
from megatron_gptoss.engine_api.protocol import SamplingParams
from megatron_gptoss.hf.convert import iter_hf_tensors
from megatron_gptoss.model import GPTOSSModel, token_logprobs
from megatron_gptoss.ops import batch_invariant
from megatron_gptoss.rollout.embedded import EmbeddedEngine


def random_model(config, device, dtype, std: float, router_std: float, output_std: float) -> GPTOSSModel:
    """Weights drawn on the device: N(0, std), the router N(0, router_std), the output layer N(0,
    output_std), norms 1, biases and sinks 0."""
    model = GPTOSSModel(config, dtype=dtype, device=device)
    torch.manual_seed(0)  # the default generators (the engine's own init draws from them too)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith("bias") or "softmax_offset" in name:
                p.zero_()
            else:
                scale = router_std if "router" in name else output_std if "output_layer" in name else std
                p.normal_(0.0, scale)
    return model.eval()


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def capture_routers(model: GPTOSSModel, on: bool) -> list:
    routers = [layer.mlp.router for layer in model.decoder.layers.values()]
    for router in routers:
        router.capture = [] if on else None
    return routers


def learner_pass(model, outs, prompts, pack: int, routing_of: list | None, device):
    """(per sequence the log-probs of its tokens after the first, per layer the learner's experts
    [tokens, k], seconds); `routing_of`: per sequence the experts to replay [tokens, layers, k], or None."""
    routers = capture_routers(model, True)
    logprobs = []
    sync(device)
    start = time.perf_counter()
    for first in range(0, len(outs), pack):
        seqs = [p + o.token_ids for p, o in zip(prompts[first : first + pack], outs[first : first + pack])]
        inputs = [s[:-1] for s in seqs]
        ids = torch.tensor([t for s in inputs for t in s], device=device)[None]
        positions = torch.cat([torch.arange(len(s)) for s in inputs]).to(device)[None]
        lengths = torch.tensor([len(s) for s in inputs])
        cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).int()]).to(device)
        routing = None
        if routing_of is not None:
            routing = torch.cat(routing_of[first : first + pack]).to(device)
        with torch.no_grad():
            hidden = model.hidden_states(
                ids, positions, cu_seqlens=cu, max_seqlen=int(lengths.max()), routing=routing
            )
            targets = torch.tensor([t for s in seqs for t in s[1:]], device=device)
            lp = token_logprobs(hidden[0], model.output_weight(), targets).cpu()
        logprobs += list(lp.split(lengths.tolist()))
    sync(device)
    seconds = time.perf_counter() - start
    experts = [torch.cat(r.capture).cpu() for r in routers]
    capture_routers(model, False)
    return logprobs, experts, seconds


def response_logprobs(all_lp, prompts, outs) -> torch.Tensor:
    """The learner's log-probs of the sampled tokens only (each sequence's last len(response) entries)."""
    return torch.cat([lp[len(lp) - len(o.token_ids) :] for lp, o in zip(all_lp, outs)])


def routing_flips(engine_routing: torch.Tensor, learner_experts: list[torch.Tensor]) -> float:
    """Fraction of (token, layer) pairs whose expert sets differ."""
    learner = torch.stack(learner_experts, dim=1).sort(-1).values
    engine = engine_routing.long().sort(-1).values
    return float((learner != engine).any(-1).float().mean())


def entropies(model, outs, prompts, device) -> tuple[float, float]:
    """Mean entropy (nats) of the router's softmax over all experts and of the output distribution, on the
    first sequence."""
    seq = prompts[0] + outs[0].token_ids
    ids = torch.tensor(seq, device=device)[None]
    router_h = []
    hooks = [
        layer.mlp.router.register_forward_hook(
            lambda m, i, o: router_h.append(
                -(o[0].float().log_softmax(-1).exp() * o[0].float().log_softmax(-1)).sum(-1).mean()
            )
        )
        for layer in model.decoder.layers.values()
    ]
    with torch.no_grad():
        hidden = model.hidden_states(ids)
        _, ent = token_logprobs(hidden[0, :-1], model.output_weight(), ids[0, 1:], with_entropy=True)
    for h in hooks:
        h.remove()
    return float(torch.stack(router_h).mean()), float(ent.float().mean())


def cost_model(args, device, dtype) -> GPTOSSModel:
    """The timed block: bench_train's two gpt-oss-120b layers (sliding, full) with a --cost-vocab head."""
    if args.tiny:
        config = gpt_oss_tiny(attention_backend="triton")
    else:
        config = gpt_oss_120b(
            num_layers=2, vocab_size=args.cost_vocab, attention_backend="triton", max_position_embeddings=4096
        )
    return random_model(config, device, dtype, args.std, args.router_std, args.output_std).train()


def packed_tokens(vocab: int, tokens: int, doc_len: int, device) -> tuple[torch.Tensor, ...]:
    """`tokens` + 1 random token ids and, for the first `tokens` of them in documents of `doc_len`, their
    positions [1, tokens] and cu_seqlens."""
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, vocab, (tokens + 1,), generator=gen).to(device)
    lengths = torch.tensor([min(doc_len, tokens - s) for s in range(0, tokens, doc_len)])
    positions = torch.cat([torch.arange(int(n)) for n in lengths]).to(device)[None]
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).int()]).to(device)
    return ids, positions, cu


def fwd_bwd_ms(model: GPTOSSModel, packed: tuple[torch.Tensor, ...], doc_len: int, invariant: bool, device):
    """Milliseconds of one forward + backward pass over `packed` (`packed_tokens`), the token-mean log-prob of
    each next token as the loss, with the batch-invariant mode `invariant`; the gradients dropped after."""
    ids, positions, cu = packed
    with batch_invariant.enabled(invariant):
        sync(device)
        start = time.perf_counter()
        hidden = model.hidden_states(ids[None, :-1], positions, cu_seqlens=cu, max_seqlen=doc_len)
        loss = -token_logprobs(hidden[0], model.output_weight(), ids[1:]).mean()
        loss.backward()
        sync(device)
        ms = 1e3 * (time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    return ms


def cost(args, device, dtype) -> list[tuple[str, float, float]]:
    """(setting, median ms, spread) of the forward + backward with the library kernels and batch-invariant,
    measured in alternating rounds after one warm-up pass each (module doc)."""
    model = cost_model(args, device, dtype)
    doc_len = min(args.doc_len, args.cost_tokens)
    packed = packed_tokens(model.config.vocab_size, args.cost_tokens, doc_len, device)
    samples: dict[bool, list[float]] = {False: [], True: []}
    for invariant in samples:  # warm-up: compilation, autotuning, the allocator's pools
        fwd_bwd_ms(model, packed, doc_len, invariant, device)
    for _ in range(args.iters):
        for invariant, times in samples.items():
            times.append(fwd_bwd_ms(model, packed, doc_len, invariant, device))
    rows = []
    for invariant, times in samples.items():
        median = statistics.median(times)
        name = "batch-invariant" if invariant else "library kernels"
        rows.append((name, median, (max(times) - min(times)) / median))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--pack", type=int, default=16)
    parser.add_argument("--std", type=float, default=0.02)
    parser.add_argument("--router-std", type=float, default=0.3)
    parser.add_argument("--output-std", type=float, default=0.1)
    parser.add_argument("--cost-tokens", type=int, default=16384, help="tokens of the timed block (0: none)")
    parser.add_argument("--cost-vocab", type=int, default=2048)
    parser.add_argument("--doc-len", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if args.tiny:
        config = gpt_oss_tiny(attention_backend="triton")
        args.cost_tokens = min(args.cost_tokens, 64)
        args.rows, args.prompt_len, args.new_tokens = (
            min(args.rows, 8),
            min(args.prompt_len, 12),
            min(args.new_tokens, 6),
        )
    else:
        config = gpt_oss_120b(
            num_layers=args.layers, attention_backend="triton", max_position_embeddings=4096
        )
    learner = random_model(config, device, dtype, args.std, args.router_std, args.output_std)
    gen = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(0, config.vocab_size, (args.prompt_len,), generator=gen).tolist()
        for _ in range(args.rows)
    ]
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, seed=3)
    rows = []
    settings = [  # (name, batch-invariant, engine records routing, r3 replay, decode graphs)
        ("none", False, True, False, False),
        ("r3", False, True, True, False),
        ("bitwise", True, True, False, False),
        ("r3, CUDA graphs", False, True, True, True),  # the routing from the graphs' static buffers
        ("none, CUDA graphs", False, False, False, True),
        ("bitwise, CUDA graphs", True, False, False, True),
        ("none, CUDA graphs (again)", False, False, False, True),  # re-captured after the bitwise ones
    ]
    engines: dict[bool, EmbeddedEngine] = {}  # one engine per routing record, reconfigured per setting
    for name, invariant, record, replayed, graphs in settings:
        options = EmbeddedEngineConfig(
            max_batch_slots=args.rows, record_routing=record, cuda_graphs="auto" if graphs else "off"
        )
        print(f"{name} ...", flush=True)
        with batch_invariant.enabled(invariant):
            engine = engines.get(record)
            if engine is None:
                engines.clear()
                engine = engines[record] = EmbeddedEngine(config, dtype=dtype, device=device, options=options)
                engine.update_weights(iter_hf_tensors(learner, config))
            engine.reconfigure(options)  # the decode graphs (if any) are captured afresh in this mode
            engine.generate(prompts[:4], SamplingParams(temperature=1.0, max_new_tokens=2, seed=1))  # warm-up
            sync(device)
            start = time.perf_counter()
            outs = engine.generate(prompts, params)
            sync(device)
            gen_s = time.perf_counter() - start
            replay = [o.routing for o in outs] if replayed else None
            all_lp, experts, learn_s = learner_pass(learner, outs, prompts, args.pack, replay, device)
            flips = math.nan
            if record:  # the learner's own experts (under replay: from a pass without it)
                own = (
                    experts
                    if not replayed
                    else learner_pass(learner, outs, prompts, args.pack, None, device)[1]
                )
                flips = routing_flips(torch.cat([o.routing for o in outs]), own)
        engine_lp = torch.tensor([x for o in outs for x in o.logprobs])
        delta = (engine_lp - response_logprobs(all_lp, prompts, outs)).abs()
        rows.append((name, float(delta.mean()), float(delta.max()), flips, gen_s, learn_s, len(engine_lp)))
        if name == "none":
            router_h, output_h = entropies(learner, outs, prompts, device)
            base_outs = outs
    # r2: the learner against itself, packed against one sequence at a time, without and with replay
    packed_lp, packed_experts, _ = learner_pass(learner, base_outs, prompts, args.pack, None, device)
    packed = response_logprobs(packed_lp, prompts, base_outs)
    lengths = [len(p) + len(o.token_ids) - 1 for p, o in zip(prompts, base_outs)]
    replay = list(torch.stack(packed_experts, 1).split(lengths))
    for name, routing_of in (("r2 off (learner vs learner)", None), ("r2 (learner vs learner)", replay)):
        single_lp, single_experts, learn_s = learner_pass(learner, base_outs, prompts, 1, routing_of, device)
        d = (packed - response_logprobs(single_lp, prompts, base_outs)).abs()
        if routing_of is None:  # under replay the captured experts are the replayed ones: keep the off row's
            flips = routing_flips(torch.stack(packed_experts, 1), single_experts)
        rows.append((name, float(d.mean()), float(d.max()), flips, math.nan, learn_s, len(d)))
    print(
        f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, {dtype},"
        f" {args.layers}-layer model"
        f" of width {config.hidden_size}, {config.num_experts} experts top-{config.moe_router_topk}, "
        f"{args.rows} rows x {args.new_tokens} new tokens after {args.prompt_len}"
    )
    print(
        f"router entropy {router_h:.3f} nats (uniform {math.log(config.num_experts):.3f}), "
        f"output entropy {output_h:.3f} nats (uniform {math.log(config.vocab_size):.3f})"
    )
    print("| setting | tokens | mean abs delta | max abs delta | routing differs | generate s | learner s |")
    print("|---|---|---|---|---|---|---|")
    for name, mean, mx, fl, g, l, n in rows:
        print(f"| {name} | {n} | {mean:.3e} | {mx:.3e} | {fl:.4f} | {g:.2f} | {l:.2f} |")
    if args.cost_tokens > 0:
        del engine, engines, learner
        if device == "cuda":
            torch.cuda.empty_cache()
        timed = cost(args, device, dtype)
        base = timed[0][1]
        print(f"learner forward + backward, 2-layer block, {args.cost_tokens} tokens, {args.iters} rounds:")
        print("| kernels | ms | spread | / library (goal <= 1.15) |")
        print("|---|---|---|---|")
        for name, ms, spread in timed:
            print(f"| {name} | {ms:.2f} | {100 * spread:.1f}% | {ms / base:.3f} |")


if __name__ == "__main__":
    main()
