"""Mixture of experts of GPT-OSS: top-k router with bias, clamped SwiGLU experts with biases.

Router: logits = x W^T + b in the parameter dtype (fp32 when `moe_router_fp32`); top-k on the logits,
softmax over the k in fp32. Experts: tokens sorted by expert, fc1 -> [gate; up] -> clamped SwiGLU
(`(up + 1) * gate * sigmoid(alpha * gate)`) -> fc2, weighted by the router probability and summed.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_gptoss.config import ModelConfig
from megatron_gptoss.model.lora import LoRA, active, make_adapter
from megatron_gptoss.model.mxfp4_weight import MXFP4Weight
from megatron_gptoss.ops import batch_invariant, fused_moe, moe_decode, mxfp4_gemm

# The decode expert kernels (`ops.moe_decode`) take a forward of at most this many rows per expert on
# average. They stream each hit expert's weight once per tile of at most 128 of its rows, so their time is
# the weight read while the rows are few; with more rows the GEMMs turn compute-bound, where the library's
# grouped GEMM is the faster. Measured at gpt-oss-20b widths on an H100 (benchmarks/bench_moe_decode.py):
# 8 and 32 rows per expert 1.20x and 1.14x faster than the library, 128 rows 0.96x; 64 lies between, untimed.
DECODE_ROWS_PER_EXPERT = 64


def no_route(dtype: torch.dtype) -> int:
    """The value marking a token without a replayed routing in a routing tensor of `dtype` (uint8: 255;
    wider integers: -1)."""
    return 255 if dtype == torch.uint8 else -1


def routing_dtype(num_experts: int) -> torch.dtype:
    """One byte per choice when the experts and the no-route mark fit (<= 255 experts), else int16."""
    return torch.uint8 if num_experts <= 255 else torch.int16


class Router(nn.Module):
    """Top-k routing. Router replay: `forward(x, replay)` with replay [N, k] routes each token to the given
    experts (rows holding `no_route` route as usual), the gates being the softmax of the router's logits
    at those experts, so the router still receives gradients. `capture` (a list, or None) collects each
    forward's experts; `flips` (a [2] int64 tensor, or None) accumulates (replayed tokens whose experts
    differ from the router's own top-k, replayed tokens). In the batch-invariant mode each token's k choices
    come in expert-id order (the experts' outputs are summed in that order, `Experts.forward`), whatever
    the order of the top-k or of a replayed row."""

    def __init__(self, config: ModelConfig, dtype=None, device=None):
        super().__init__()
        self.topk, self.fp32 = config.moe_router_topk, config.moe_router_fp32
        self.weight = nn.Parameter(
            torch.empty(config.num_experts, config.hidden_size, dtype=dtype, device=device)
        )
        bias = torch.zeros(config.num_experts, dtype=dtype, device=device)
        self.bias = nn.Parameter(bias) if config.add_bias_linear else None
        h, e = config.hidden_size, config.num_experts
        self.lora = make_adapter(config.lora, "router", h, e, None, dtype, device)
        self.capture: list[torch.Tensor] | None = None
        self.flips: torch.Tensor | None = None

    def forward(
        self, x: torch.Tensor, replay: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, H] (replay [N, k] or None) -> (logits [N, E], probs [N, k] fp32, indices [N, k])."""
        if self.fp32:
            bias = None if self.bias is None else self.bias.float()
            logits = batch_invariant.linear(x.float(), self.weight.float(), bias)
        else:
            logits = batch_invariant.linear(x, self.weight, self.bias)
        lora = active(self.lora)
        if lora is not None:
            logits = logits + lora(x).to(logits.dtype)
        top, indices = torch.topk(logits, self.topk, dim=-1)
        if replay is not None:
            replay = replay.to(logits.device)
            free = replay[:, 0] == no_route(replay.dtype)
            own = indices
            indices = torch.where(free[:, None], own, replay.long())
            top = logits.gather(-1, indices)
            if self.flips is not None:
                differs = (indices.sort(-1).values != own.sort(-1).values).any(-1) & ~free
                self.flips += torch.stack([differs.sum(), (~free).sum()]).to(self.flips)
        if batch_invariant.active():  # the combine sums a token's k outputs in expert-id order
            indices, slots = indices.sort(dim=-1)
            top = top.gather(-1, slots)
        if self.capture is not None:
            self.capture.append(indices.detach())
        return logits, torch.softmax(top.float(), dim=-1), indices


def swiglu_clamped(gate_up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """[M, 2I] as [gate; up] -> [M, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, bounds: torch.Tensor, backend: str) -> torch.Tensor:
    """Rows of x sorted by expert (expert e: rows [bounds[e], bounds[e + 1])) times weight[e]^T; weight
    [E, out, in]. `grouped_mm` reads the bounds on the device; `loop` reads them on the host. While the
    batch-invariant mode is on, the product is `ops.batch_invariant`'s (its backward: `backend`'s)."""
    if batch_invariant.active():
        return batch_invariant.invariant_grouped_linear(
            x, weight, bounds, lambda x, w, b: _library_grouped_linear(x, w, b, backend)
        )
    return _library_grouped_linear(x, weight, bounds, backend)


def _library_grouped_linear(x: torch.Tensor, weight: torch.Tensor, bounds: torch.Tensor, backend: str):
    if backend == "grouped_mm":
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=bounds[1:])
    counts = (bounds[1:] - bounds[:-1]).tolist()
    pieces = [chunk @ weight[e].t() for e, chunk in enumerate(x.split(counts)) if chunk.shape[0]]
    # With no rows at all, an empty product still ties the output to `weight`, so it gets a (zero)
    # gradient like any expert without tokens (an expert-parallel rank can receive no token).
    return torch.cat(pieces) if pieces else x @ weight[0].t()


class Experts(nn.Module):
    """`linear_fc1` [E, 2I, H] ([gate; up]) / bias [E, 2I]; `linear_fc2` [E, H, I] / bias [E, H].

    E is `num_experts`: all of the config's experts by default; expert parallelism builds instances
    holding a contiguous slice of them and reuses `compute` on the tokens dispatched to it.

    Backends (`expert_backend`): `grouped_mm` (auto on CUDA) sorts the tokens on the device, runs the
    GEMMs as `torch._grouped_mm` (a loop over experts on the CPU) and the permutation, bias + SwiGLU and
    router weighting as fused Triton kernels (`megatron_gptoss.ops.fused_moe`; on the CPU under
    TRITON_INTERPRET=1): no host sync. The rollout engine's forward steps (inside `moe_decode.decode_scope`)
    over few rows per expert, without autograd (`decode_kernels`), run the GEMMs with their bias and
    SwiGLU as `ops.moe_decode`'s kernels, active adapters' updates (computed as the fused path computes
    them) added in the kernels' epilogues.
    `loop` (auto on the CPU) is the eager reference: a loop over experts with the per-expert counts read
    on the host.

    MXFP4 experts (`expert_format: mxfp4`): the fc1 / fc2 weights are `MXFP4Weight`s (frozen uint8 blocks
    and scales, no gradient). The fused path multiplies by them as they are
    (`ops.mxfp4_gemm.grouped_linear_mxfp4`, differentiable in the rows), the decode path with
    `fc1_swiglu_mxfp4` and `grouped_linear_mxfp4`; the `loop` reference and the batch-invariant mode
    multiply by the dequantized weights. Biases and adapters are as with bf16 experts.
    """

    def __init__(self, config: ModelConfig, dtype=None, device=None, num_experts: int | None = None):
        super().__init__()
        e = config.num_experts if num_experts is None else num_experts
        h, i = config.hidden_size, config.intermediate_size
        self.num_experts, self.limit, self.alpha = e, config.swiglu_limit, config.swiglu_alpha
        self.backend = config.expert_backend
        packed = config.mxfp4_byte_format if config.expert_format == "mxfp4" else None
        self.linear_fc1 = _ExpertLinear(e, 2 * i, h, config.add_bias_linear, dtype, device, packed)
        self.linear_fc2 = _ExpertLinear(e, h, i, config.add_bias_linear, dtype, device, packed)
        self.linear_fc1.lora = make_adapter(config.lora, "linear_fc1", h, 2 * i, e, dtype, device)
        self.linear_fc2.lora = make_adapter(config.lora, "linear_fc2", i, h, e, dtype, device)

    def fused(self, x: torch.Tensor) -> bool:
        """Whether the fused kernels run (the `grouped_mm` backend) for input x."""
        if self.backend != "auto":
            return self.backend == "grouped_mm"
        if batch_invariant.active():  # its grouped GEMM and the fused kernels: no host sync
            return True
        return x.is_cuda and hasattr(torch, "_grouped_mm") and fused_moe.triton_available()

    def decode_kernels(self, x: torch.Tensor) -> bool:
        """Whether `compute` runs the decode expert kernels (`ops.moe_decode`, forward only) for rows x: on
        CUDA in 16-bit floats (in fp32 their products are FMA loops, slower than the library's), where
        `decode_eligible`."""
        half = x.dtype in (torch.bfloat16, torch.float16)
        return x.is_cuda and half and fused_moe.triton_available() and self.decode_eligible(x)

    def decode_eligible(self, x: torch.Tensor) -> bool:
        """The decode kernels' conditions but the device: inside `moe_decode.decode_scope` (the rollout
        engine's steps; never the learner's forwards), the fused path, nothing for autograd to record
        (adapters included), no active adapter drawing dropout (`LoRA.drops`), the batch-invariant mode off,
        x in the weights' dtype and at most `DECODE_ROWS_PER_EXPERT` rows per expert on average."""
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        if not moe_decode.in_decode_scope():
            return False
        if not self.fused(x) or batch_invariant.active() or x.dtype != fc1.dtype:
            return False
        adapters = [lora for lora in (active(fc1.lora), active(fc2.lora)) if lora is not None]
        if any(lora.drops for lora in adapters):
            return False
        params = [x, fc1.weight, fc1.bias, fc2.weight, fc2.bias]
        params += [p for lora in adapters for p in lora.parameters()]
        if torch.is_grad_enabled() and any(isinstance(p, torch.Tensor) and p.requires_grad for p in params):
            return False
        return x.shape[0] <= DECODE_ROWS_PER_EXPERT * self.num_experts

    def compute(self, x: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
        """Rows x [M, H] sorted by expert (this instance's expert e: rows [bounds[e], bounds[e + 1]),
        bounds int32 [E + 1] on x's device) -> the experts' outputs [M, H], not yet weighted."""
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        gemm = "grouped_mm" if x.is_cuda else "loop"  # the fused path's grouped GEMM
        if self.decode_kernels(x):
            gemm = "decode"  # the adapters' factors by the decode kernel too (`_ExpertLinear.update`)
            w1, w2 = fc1.weight, fc2.weight
            if isinstance(w1, MXFP4Weight) and isinstance(w2, MXFP4Weight):
                h = mxfp4_gemm.fc1_swiglu_mxfp4(
                    x, w1.blocks, w1.scales, fc1.bias, bounds, self.limit, self.alpha,
                    addend=fc1.update(x, bounds, gemm), byte_format=w1.byte_format,
                )  # fmt: skip
                return mxfp4_gemm.fc2_bias_mxfp4(
                    h, w2.blocks, w2.scales, fc2.bias, bounds, addend=fc2.update(h, bounds, gemm),
                    byte_format=w2.byte_format,
                )  # fmt: skip
            assert isinstance(w1, torch.Tensor) and isinstance(w2, torch.Tensor)
            h = moe_decode.decode_fc1(
                x, w1, fc1.bias, bounds, self.limit, self.alpha, addend=fc1.update(x, bounds, gemm)
            )
            return moe_decode.decode_fc2(h, w2, fc2.bias, bounds, addend=fc2.update(h, bounds, gemm))
        if self.fused(x):
            h = fc1(x, bounds, gemm, packed=True)
            h = fused_moe.swiglu_bias(h, fc1.bias, bounds, self.limit, self.alpha)
            y = fc2(h, bounds, gemm, packed=True)
            return y if fc2.bias is None else fused_moe.expert_bias(y, fc2.bias, bounds)
        expert = fused_moe.expert_of_rows(bounds, x.shape[0])
        h = fc1(x, bounds, "loop")
        # index_select, not bias[expert]: the backward of advanced indexing is index_put_(accumulate=True),
        # which on the CPU with several threads adds with float atomics in a racing order (run-to-run bit
        # differences); index_select's backward is index_add_, serial in row order on the CPU.
        if fc1.bias is not None:
            h = h + fc1.bias.index_select(0, expert)
        h = swiglu_clamped(h, self.limit, self.alpha)
        y = fc2(h, bounds, "loop")
        if fc2.bias is not None:
            y = y + fc2.bias.index_select(0, expert)
        return y

    def forward(self, x: torch.Tensor, probs: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """x [N, H], probs/indices [N, k] -> [N, H]."""
        k = indices.shape[1]
        slot_rows, bounds, order = fused_moe.sort_by_expert(indices, self.num_experts)
        if self.fused(x):
            rows = self.compute(fused_moe.permute(x, slot_rows, k), bounds)
            return fused_moe.unpermute(rows, probs, slot_rows)
        token = order // k
        y = self.compute(x.index_select(0, token), bounds)  # not x[token]: see compute
        y = (y.float() * probs.reshape(-1)[order, None]).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token, y)


class _ExpertLinear(nn.Module):
    """`weight` [E, out, in] (a parameter, or an `MXFP4Weight` holding its bytes in the byte format `packed`),
    `bias` [E, out] (applied by the caller) and an optional per-expert adapter `lora`. Called on rows sorted
    by expert: the grouped product with `weight` plus the adapter's."""

    def __init__(
        self, experts: int, out_features: int, in_features: int, bias: bool, dtype, device,
        packed: str | None = None,
    ):  # fmt: skip
        super().__init__()
        self.weight: nn.Parameter | MXFP4Weight
        if packed:
            self.weight = MXFP4Weight(experts, out_features, in_features, dtype, device, packed)
        else:
            self.weight = nn.Parameter(
                torch.empty(experts, out_features, in_features, dtype=dtype, device=device)
            )
        self.bias = (
            nn.Parameter(torch.zeros(experts, out_features, dtype=dtype, device=device)) if bias else None
        )
        self.lora: LoRA | None = None

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the product runs in (an MXFP4 weight's: the run's dtype)."""
        return self.weight.dtype

    def forward(self, x: torch.Tensor, bounds: torch.Tensor, gemm: str, packed: bool = False) -> torch.Tensor:
        """Rows x sorted by expert -> x W^T (+ the adapter's update). An MXFP4 weight is multiplied as it is
        stored when `packed` (the fused path) and the batch-invariant mode is off, else dequantized."""
        weight = self.weight
        if not isinstance(weight, MXFP4Weight):
            y = grouped_linear(x, weight, bounds, gemm)
        elif packed and not batch_invariant.active():
            y = mxfp4_gemm.grouped_linear_mxfp4(
                x, weight.blocks, weight.scales, bounds, byte_format=weight.byte_format
            )
        else:
            y = grouped_linear(x, weight.dequantize(x.dtype), bounds, gemm)
        update = self.update(x, bounds, gemm)
        return y if update is None else y + update

    def update(self, x: torch.Tensor, bounds: torch.Tensor, gemm: str) -> torch.Tensor | None:
        """The active adapter's update [M, out] of rows x sorted by expert (`LoRA.grouped` by `grouped_linear`
        with `gemm`, or by `moe_decode.decode_grouped` with gemm "decode": the decode path's, where the
        library's grouped GEMM spends most of its time preparing the groups of so few rows), or None without
        an active adapter."""
        lora = active(self.lora)
        if lora is None:
            return None
        if gemm == "decode":
            return lora.grouped(x, bounds, moe_decode.decode_grouped)
        return lora.grouped(x, bounds, lambda rows, w, b: grouped_linear(rows, w, b, gemm))


class MoE(nn.Module):
    def __init__(self, config: ModelConfig, dtype=None, device=None):
        super().__init__()
        self.router = Router(config, dtype, device)
        self.experts = Experts(config, dtype, device)

    def forward(self, x: torch.Tensor, replay: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., H]; replay [tokens, k] (router replay) or None."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        _, probs, indices = self.router(flat, replay)
        return self.experts(flat, probs, indices).reshape(shape)
