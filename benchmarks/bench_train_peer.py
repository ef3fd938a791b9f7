"""The peer of `benchmarks/bench_train.py`: torchtitan's GPT-OSS at the bench's shapes, timed the same way.

torchtitan is pinned to one release (`TORCHTITAN_VERSION`); its wheel and the pure-Python packages its
model code imports (`PEER_PACKAGES`) travel in the repository's ignored `.whl/` directory, fetched there by

    python3 benchmarks/bench_train_peer.py --fetch      # pip download --no-deps -d .whl <the pinned packages>

and installed on a machine without network by `pip install --no-index --no-deps --target DIR .whl/*.whl`
with DIR on PYTHONPATH.

The peer is the release's `gpt_oss` model (fused QKV, YaRN RoPE, sinks, token-choice top-k MoE with
grouped GEMMs) at gpt-oss-120b width, built from its own layer factory with the bench's layer count and
head vocabulary, bf16 parameters, its per-block `torch.compile(fullgraph=True)` as its trainer applies
it, and its `varlen` attention (FlashAttention through `torch.nn.attention.varlen.varlen_attn`) over
the packed documents, whose boundaries it finds from the positions. Its loss is the token-mean cross
entropy of the head, the same quantity as the bench's log-prob loss.

Known gradient defect (stated beside its timing): the peer applies the sinks after the attention
kernel, rescaling the output by sigmoid(lse - sink). The rescale is exact in the forward, but the
kernel's backward ignores the gradient that reaches its log-sum-exp, so the query and key gradients
miss the sink term; the peer's backward does less work than a correct one.

Without CUDA (no FlashAttention) the peer's varlen attention calls `eager_varlen_attn`, the same call
computed per document in plain torch, so the rest of its code (its varlen attention module, the sink
rescale, the boundaries from positions) runs on the CPU.
"""

from __future__ import annotations

import argparse
import importlib
import math
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from step_probe import spread_pct

from megatron_gptoss.utils.host import collect_between_steps

TORCHTITAN_VERSION = "0.3.0"
# the peer and what its model code imports beyond torch: package -> pinned version (pure Python wheels)
PEER_PACKAGES = {
    "torchtitan": TORCHTITAN_VERSION,
    "spmd_types": "0.2.3",
    "tyro": "1.0.17",
    "docstring_parser": "0.18.0",
    "typeguard": "4.6.1",
}
PEER_WHEELS = tuple(f"{name}-{version}-py3-none-any.whl" for name, version in PEER_PACKAGES.items())
PEER_DEFECT = (
    "sinks applied through the log-sum-exp after FlashAttention: its backward drops the sink term "
    "from the query/key gradients"
)


def timing_summary(times: Sequence[float]) -> dict[str, float]:
    """Median, min and max of step times in seconds, and the spread (max - min) / median in percent."""
    if not times:
        raise ValueError("timing_summary needs at least one step time")
    median = statistics.median(times)
    return {
        "median_s": median,
        "min_s": min(times),
        "max_s": max(times),
        "spread_pct": spread_pct(list(times)),
    }


def time_steps(
    step: Callable[[], None],
    warmup: int,
    iters: int,
    device: torch.device,
    prepare: Callable[[], None] | None = None,
    align: Callable[[], None] | None = None,
    probe=None,
) -> list[float]:
    """Wall time of `iters` calls of `step` after `warmup` untimed ones, the device synchronized around
    each; `prepare` (zeroing gradients) runs before each step, untimed. Python's garbage collector runs
    between steps, untimed, and is off during them (as trainers do: a collection inside a step stalls the
    host that feeds the GPU). `align` (a barrier across ranks) runs last before each step, untimed, so every
    rank's step starts together: without it a rank that starts early times its wait for the others at the
    step's first collective. `probe` (a `step_probe.StepProbe`, or None) records each step's clocks and
    allocator activity."""
    times = []
    for it in collect_between_steps(range(warmup + iters), every=1):
        if prepare is not None:
            prepare()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if align is not None:
            align()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        if probe is not None:
            probe.begin()
        start = time.perf_counter()
        step()
        if probe is not None:
            probe.launched()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if probe is not None:
            probe.end()
        if it >= warmup:
            times.append(time.perf_counter() - start)
    return times


def packed_positions(docs: Sequence[int]) -> torch.Tensor:
    """(1, sum(docs)) int64 positions restarting at 0 at every document: how the peer marks the
    documents of a packed row."""
    if not docs or min(docs) < 1:
        raise ValueError(f"document lengths must be positive, got {list(docs)}")
    return torch.cat([torch.arange(n) for n in docs]).unsqueeze(0)


def eager_varlen_attn(
    query,
    key,
    value,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    *,
    return_aux=None,
    scale=None,
    window_size=(-1, -1),
    **_,
):
    """Plain-torch stand-in for `torch.nn.attention.varlen.varlen_attn` (same call, same outputs) where
    FlashAttention is missing: q/k/v (tokens, heads, dim) of documents `cu_seq_q` (self-attention:
    cu_seq_k the same), window (left, right) keys around each query (-1: unlimited), GQA by repeating
    the KV heads. Returns the output, and with `return_aux.lse` also the natural-log log-sum-exp of the
    scaled scores, (heads, tokens) fp32."""
    scale = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
    rep = query.shape[1] // key.shape[1]
    bounds = [int(b) for b in cu_seq_q.tolist()]
    left, right = window_size
    outs, lses = [], []
    for s, e in zip(bounds[:-1], bounds[1:], strict=True):
        q = query[s:e].transpose(0, 1).float()
        k = key[s:e].repeat_interleave(rep, dim=1).transpose(0, 1).float()
        v = value[s:e].repeat_interleave(rep, dim=1).transpose(0, 1).float()
        scores = q @ k.transpose(1, 2) * scale
        i = torch.arange(e - s, device=query.device)
        offset = i[:, None] - i[None, :]  # query minus key position
        visible = torch.ones_like(offset, dtype=torch.bool)
        if left >= 0:
            visible &= offset <= left
        if right >= 0:
            visible &= offset >= -right
        scores = scores.masked_fill(~visible, float("-inf"))
        lses.append(torch.logsumexp(scores, dim=-1))
        outs.append((torch.softmax(scores, dim=-1) @ v).transpose(0, 1))
    out = torch.cat(outs).to(query.dtype)
    if return_aux is not None and return_aux.lse:
        return out, torch.cat(lses, dim=1)
    return out


def peer_config(
    *,
    dim: int,
    hidden_dim: int,
    num_experts: int,
    top_k: int,
    num_layers: int,
    vocab: int,
    attn_backend: str = "varlen",
):
    """The peer's GPT-OSS config from its own layer factory (as its 120b flavor builds it: 64 query /
    8 KV heads of 64, even layers sliding with a 128-token window, YaRN RoPE) at these widths."""
    tt = import_peer()
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear, RMSNorm

    rope = CosSinRoPE.Config(
        dim=64,
        max_seq_len=131072,
        theta=150000.0,
        scaling="yarn",
        rope_factor=32,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
        original_seq_len=4096,
    )
    layers = tt._build_gptoss_layers(
        fuse_qkv=True,
        dim=dim,
        n_layers=num_layers,
        hidden_dim=hidden_dim,
        num_experts=num_experts,
        top_k=top_k,
        load_balance_coeff=1e-3,
        attn_backend=attn_backend,
        moe_comm_backend="standard",
        rope=rope,
    )
    return tt.GptOssModel.Config(
        dim=dim,
        vocab_size=vocab,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab, embedding_dim=dim, param_init=tt._EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=tt._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=tt._output_linear_init(dim)),
        layers=layers,
    )


_MISSING_NAME = re.compile(r"cannot import name '(\w+)' from '(torch[\w.]*)'")
# names of newer torch releases the peer's package imports (at module level) for code the one-GPU block never
# runs, filled in by `import_peer` with placeholders
TORCH_PLACEHOLDERS: list[str] = []


def import_peer(module: str = "torchtitan.models.gpt_oss", limit: int = 8):
    """Import `module` of the peer. A name that this torch lacks and the peer imports from a torch module
    (torchtitan 0.3.0's FSDP helpers import `torch.distributed.fsdp.DataParallelMeshDims`, new after torch
    2.11) becomes a placeholder class, listed in TORCH_PLACEHOLDERS: code that used one would fail where it
    does, and the single-GPU block calls none of it. Other import errors are raised."""
    for _ in range(limit):
        try:
            return importlib.import_module(module)
        except ImportError as err:
            match = _MISSING_NAME.search(str(err))
            if match is None:
                raise
            name, owner = match.groups()
            if hasattr(importlib.import_module(owner), name):
                raise
            setattr(importlib.import_module(owner), name, type(name, (), {"__module__": owner}))
            TORCH_PLACEHOLDERS.append(f"{owner}.{name}")
            for loaded in [m for m in sys.modules if m.split(".")[0] == module.split(".")[0]]:
                del sys.modules[loaded]  # half-imported modules of the failed attempt
    raise ImportError(f"{module}: more than {limit} names missing from this torch ({TORCH_PLACEHOLDERS})")


def use_available_flash_attention() -> str:
    """The FlashAttention the peer's varlen attention will run: it asks for FA3 on Hopper (FA4 from
    Blackwell), which needs that kernel's package; where activating it fails (torch 2.11 lists FA3 but
    `flash_attn_interface` is not installed) it is pointed at torch's built-in FA2 (as it does below
    Hopper). Returns the name."""
    import torchtitan.tools.utils as tt_utils

    wanted = tt_utils.get_cuda_flash_attention_impl()
    if wanted is None:
        return "FA2"
    try:
        from torch.nn.attention import activate_flash_attention_impl

        activate_flash_attention_impl(wanted)
    except (ImportError, RuntimeError, ValueError, KeyError):  # not registered, or its package missing
        tt_utils.get_cuda_flash_attention_impl = lambda: None
        return "FA2"
    return wanted


def adapt_varlen_call(varlen_attn: Callable) -> tuple[Callable, str]:
    """`varlen_attn` behind the keywords the peer passes (`enable_gqa`, `num_splits`) where this torch's
    lacks them: GQA by repeating the KV heads (dim 1 of the (tokens, heads, dim) layout), no split
    count (the kernel's own choice). Returns the callable and a note of what was adapted ('' if
    nothing)."""
    import inspect

    missing = {"enable_gqa", "num_splits"} - set(inspect.signature(varlen_attn).parameters)
    if not missing:
        return varlen_attn, ""

    def call(q, k, v, *args, enable_gqa: bool = False, num_splits=None, **kwargs):
        if enable_gqa and "enable_gqa" in missing and k.shape[1] != q.shape[1]:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        elif enable_gqa:
            kwargs["enable_gqa"] = True
        if num_splits is not None and "num_splits" not in missing:
            kwargs["num_splits"] = num_splits
        return varlen_attn(q, k, v, *args, **kwargs)

    notes = {"enable_gqa": "GQA by repeated KV heads", "num_splits": "default split count"}
    return call, "; ".join(notes[name] for name in sorted(missing)) + " (this torch's varlen_attn lacks them)"


def build_peer(config, device: torch.device, dtype: torch.dtype, compile_blocks: bool):
    """The peer model on `device` with parameters in `dtype` (buffers such as the RoPE cache keep
    theirs); off CUDA its varlen attention calls `eager_varlen_attn`; each block compiled as its trainer
    does (`fullgraph=True`, scalar outputs captured for the MoE's data-dependent shapes)."""
    import torchtitan.models.common.attention as tt_attention

    if device.type == "cuda":
        use_available_flash_attention()
        tt_attention.varlen_attn, _ = adapt_varlen_call(tt_attention.varlen_attn)
    else:
        tt_attention.varlen_attn = eager_varlen_attn
    with torch.device(device):
        model = config.build()
    model.init_states(buffer_device=device)
    for p in model.parameters():
        p.data = p.data.to(dtype)
    if compile_blocks:
        torch._dynamo.config.capture_scalar_outputs = True
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 12)
        for block in model.layers.values():
            block.compile(fullgraph=True)
    return model


def peer_step(model, tokens: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """One forward + backward of the token-mean cross entropy; returns the (detached) loss."""
    masks = model.get_attention_masks(positions)
    logits = model(tokens, positions, masks)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    loss.backward()
    return loss.detach()


def run_peer(
    *,
    model_config,
    docs: Sequence[int],
    device: torch.device,
    warmup: int,
    iters: int,
    seed: int = 0,
    compile_blocks: bool | None = None,
    probe=None,
) -> dict:
    """Build the peer at `model_config`'s widths (a megatron_gptoss ModelConfig), time forward +
    backward over one packed row of `docs`, and return the timing summary with the first loss (`probe`:
    as in `time_steps`)."""
    config = peer_config(
        dim=model_config.hidden_size,
        hidden_dim=model_config.intermediate_size,
        num_experts=model_config.num_experts,
        top_k=model_config.moe_router_topk,
        num_layers=model_config.num_layers,
        vocab=model_config.vocab_size,
    )
    torch.manual_seed(seed)
    cuda = device.type == "cuda"
    model = build_peer(config, device, torch.bfloat16, cuda if compile_blocks is None else compile_blocks)
    gen = torch.Generator().manual_seed(seed)
    total = sum(docs)
    tokens = torch.randint(0, model_config.vocab_size, (1, total), generator=gen).to(device)
    targets = torch.randint(0, model_config.vocab_size, (1, total), generator=gen).to(device)
    positions = packed_positions(docs).to(device)
    losses: list[torch.Tensor] = []

    def zero() -> None:
        model.zero_grad(set_to_none=True)

    def step() -> None:
        losses.append(peer_step(model, tokens, positions, targets))

    times = time_steps(step, warmup, iters, device, prepare=zero, probe=probe)
    summary = timing_summary(times)
    summary["steps_ms"] = [round(t * 1e3, 2) for t in times]
    summary["loss"] = float(losses[0])
    if cuda:
        from torch.nn.attention.varlen import varlen_attn

        adapted = adapt_varlen_call(varlen_attn)[1]
        summary["attention"] = f"varlen {use_available_flash_attention()}" + (
            f", {adapted}" if adapted else ""
        )
    else:
        summary["attention"] = "eager_varlen_attn (CPU)"
    if TORCH_PLACEHOLDERS:
        summary["torch_placeholders"] = list(TORCH_PLACEHOLDERS)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--fetch", action="store_true", help="download the pinned wheels into --dest")
    parser.add_argument("--dest", default=".whl")
    args = parser.parse_args()
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", args.dest]
    command += [f"{name}=={version}" for name, version in PEER_PACKAGES.items()]
    print(" ".join(command), flush=True)
    if args.fetch:
        subprocess.run(command, check=True)


if __name__ == "__main__":
    main()
