"""The output layer's per-token log-probs and entropy, forward + backward, at gpt-oss's vocabulary (201,088
rows, hidden 2880, bf16) on one GPU: ours (`token_logprobs`, fused kernels and PyTorch chunks) against the
unchunked computation (the peer: the whole [tokens, vocab] fp32 logits, log_softmax and autograd), with the
head trainable and frozen (LoRA trains adapters only and leaves the head's weight frozen).

    python benchmarks/bench_head.py                       # 4,096 tokens
    python benchmarks/bench_head.py --tokens 8192 --json head.json
    python benchmarks/bench_head.py --small               # a CPU smoke test (tiny widths, no fused kernels)

Each row: median wall time of --iters forward + backward passes after one warm-up, the peak memory above
the inputs during one pass (CUDA only), and the peer's time over this row's time (same trainable / frozen
setting). Every row's log-probs, entropy and gradients are compared with the peer's in the same run
(relative error, printed; a row beyond --tolerance fails the run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from megatron_gptoss.model import token_logprobs
from megatron_gptoss.model.logprobs import fused_available


def peer_logprobs(hidden, weight, targets):
    """The unchunked computation: fp32 logits of every token at once, log_softmax, gather, entropy."""
    logp = torch.log_softmax(hidden.float() @ weight.float().t(), dim=-1)
    return logp.gather(1, targets[:, None]).squeeze(1), -(logp.exp() * logp).sum(-1)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def run_row(fn, hidden, weight, targets, g_lp, g_ent, trainable: bool, iters: int) -> dict:
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_(trainable)
    cuda = hidden.is_cuda

    def step():
        h.grad, w.grad = None, None
        lp, ent = fn(h, w, targets)
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        return lp.detach(), ent.detach()

    step()
    times = []
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    h.grad, w.grad = None, None
    peak = float("nan")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    lp, ent = step()
    if cuda:
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return {"ms": 1e3 * statistics.median(times), "peak_gib": peak, "out": (lp, ent, h.grad, w.grad)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=201088)
    parser.add_argument("--hidden", type=int, default=2880)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--tolerance", type=float, default=2e-2, help="largest relative error to the peer")
    parser.add_argument("--small", action="store_true", help="tiny widths on the CPU")
    parser.add_argument("--json", default="", help="write the rows here")
    args = parser.parse_args(argv)
    if args.small:
        args.tokens, args.vocab, args.hidden, args.iters = 48, 300, 32, 1
    device = torch.device("cuda" if torch.cuda.is_available() and not args.small else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, device=device, generator=gen).to(dtype)
    weight = (0.02 * torch.randn(args.vocab, args.hidden, device=device, generator=gen)).to(dtype)
    targets = torch.randint(0, args.vocab, (args.tokens,), device=device, generator=gen)
    g_lp = torch.randn(args.tokens, device=device, generator=gen)
    g_ent = torch.randn(args.tokens, device=device, generator=gen)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"device: {name}, torch {torch.__version__}; {args.tokens} tokens, vocab {args.vocab}, "
        f"hidden {args.hidden}"
    )

    variants = {"peer: unchunked": peer_logprobs}
    if fused_available(hidden):
        variants["fused kernels"] = lambda h, w, t: token_logprobs(h, w, t, with_entropy=True, fused=True)
    variants["pytorch chunks"] = lambda h, w, t: token_logprobs(h, w, t, with_entropy=True, fused=False)
    rows, failures = [], []
    for trainable in (True, False):
        peer = None
        for label, fn in variants.items():
            row = run_row(fn, hidden, weight, targets, g_lp, g_ent, trainable, args.iters)
            out = row.pop("out")
            if peer is None:
                peer = (row["ms"], out)
            names = ("logprobs", "entropy", "grad_hidden") + (("grad_weight",) if trainable else ())
            errors = {n: rel_err(a, b) for n, a, b in zip(names, out, peer[1])}
            if not trainable and out[3] is not None:
                failures.append(f"{label}: a frozen weight got a gradient")
            failures += [f"{label} {n}: {e:.2e}" for n, e in errors.items() if e > args.tolerance]
            rows.append(
                {
                    "variant": label,
                    "head": "trainable" if trainable else "frozen",
                    **row,
                    "peer_over_this": peer[0] / row["ms"],
                    "max_rel_err": max(errors.values()),
                }
            )
    print("| variant | head | ms | peak GiB | peer time / this | max rel. error to the peer |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['variant']} | {r['head']} | {r['ms']:.2f} | {r['peak_gib']:.2f} "
            f"| {r['peer_over_this']:.2f} | {r['max_rel_err']:.1e} |"
        )
    result = {"device": name, "tokens": args.tokens, "vocab": args.vocab, "hidden": args.hidden, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if failures:
        raise SystemExit("beyond tolerance: " + "; ".join(failures))
    return result


if __name__ == "__main__":
    main()
