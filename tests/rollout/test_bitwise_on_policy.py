"""Bitwise on-policy mode (`ops.batch_invariant`): the embedded engine's logits at every sampled position, and
the log-probs it reports, equal the learner's packed training forward bit for bit, with rows of mixed lengths
finishing apart, more prompts than slots and chunked prefill. The batch-invariant kernels themselves are
checked against float64 references, and their rows against the same rows computed in other batches.

On the CPU the kernels run under TRITON_INTERPRET=1 in fp32 (the GPU test runs bf16)."""

import pytest
import torch

from megatron_gptoss.config import EmbeddedEngineConfig, gpt_oss_tiny
from megatron_gptoss.hf.convert import iter_hf_tensors
from megatron_gptoss.model import GPTOSSModel, build_model
from megatron_gptoss.model.logprobs import fp32_logits, token_logprobs
from megatron_gptoss.ops import batch_invariant
from megatron_gptoss.rollout import EmbeddedEngine, SamplingParams

CONFIG = gpt_oss_tiny(attention_backend="triton")


def rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.double() - ref.double()).norm() / ref.double().norm())


def test_invariant_kernels_match_float64_and_their_own_rows():
    gen = torch.Generator().manual_seed(0)
    x, w, b = (
        torch.randn(45, 40, generator=gen),
        torch.randn(70, 40, generator=gen),
        torch.randn(70, generator=gen),
    )
    y = batch_invariant.invariant_linear(x, w, b)
    assert rel(y, x.double() @ w.double().t() + b.double()) < 1e-6
    assert torch.equal(batch_invariant.invariant_linear(x[7:8], w, b), y[7:8])
    assert torch.equal(batch_invariant.invariant_linear(x[3:40], w, b), y[3:40])
    experts = torch.randn(3, 24, 40, generator=gen)
    bounds = torch.tensor([0, 20, 20, 45], dtype=torch.int32)
    g = batch_invariant.invariant_grouped_linear(x, experts, bounds, None)
    ref = torch.cat([x[:20].double() @ experts[0].double().t(), x[20:].double() @ experts[2].double().t()])
    assert rel(g, ref) < 1e-6
    one = batch_invariant.invariant_grouped_linear(x[30:31], experts, torch.tensor([0, 0, 0, 1]).int(), None)
    assert torch.equal(one, g[30:31])
    z = 4 * torch.randn(6, 3000, generator=gen)
    z[1, :500] = float("-inf")
    lse = batch_invariant.logsumexp_rows(z)
    assert (lse - torch.logsumexp(z.double(), -1)).abs().max() < 1e-5
    assert torch.equal(batch_invariant.logsumexp_rows(z[1:2]), lse[1:2])


def test_invariant_linear_gradients_are_the_library_ones():
    gen = torch.Generator().manual_seed(1)
    leaves = [torch.randn(*s, generator=gen, requires_grad=True) for s in ((2, 9, 40), (24, 40), (24,))]
    copies = [t.detach().clone().requires_grad_() for t in leaves]
    g = torch.randn(2, 9, 24, generator=gen)
    (batch_invariant.invariant_linear(*leaves) * g).sum().backward()
    (torch.nn.functional.linear(*copies) * g).sum().backward()
    for ours, ref in zip(leaves, copies):
        assert rel(ours.grad, ref.grad) < 1e-6


def test_invariant_grouped_linear_gradients_are_the_library_ones_and_skip_a_frozen_weight():
    """The grouped product's backward is the library grouped GEMM's (`backward_fn`), for the rows and the
    weight; with the weight frozen (LoRA) only the rows' gradient is asked of it."""
    from megatron_gptoss.model.moe import grouped_linear

    gen = torch.Generator().manual_seed(2)
    x, experts = torch.randn(45, 40, generator=gen), torch.randn(3, 24, 40, generator=gen)
    bounds = torch.tensor([0, 20, 20, 45], dtype=torch.int32)
    g = torch.randn(45, 24, generator=gen)
    asked = []

    def library(rows, weight, b):
        asked.append((rows.requires_grad, weight.requires_grad))
        return grouped_linear(rows, weight, b, "loop")

    results = []
    for trainable in (True, False):
        xs, ws = x.clone().requires_grad_(), experts.clone().requires_grad_(trainable)
        (batch_invariant.invariant_grouped_linear(xs, ws, bounds, library) * g).sum().backward()
        results.append((xs.grad, ws.grad))
    xr, wr = x.clone().requires_grad_(), experts.clone().requires_grad_()
    (grouped_linear(xr, wr, bounds, "loop") * g).sum().backward()
    (x_train, w_train), (x_frozen, w_frozen) = results
    assert rel(x_train, xr.grad) < 1e-6 and rel(w_train, wr.grad) < 1e-6
    assert torch.equal(x_frozen, x_train) and w_frozen is None
    assert asked == [(True, True), (True, False)]


def make_learner(device="cpu", dtype=torch.float32):
    """The tiny model with larger weights than the init (peaked routing and logits hide less), built in
    `dtype` on `device` (its rotary frequencies stay fp32, as in every model built in a dtype)."""
    model = build_model(CONFIG, seed=4)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    learner = GPTOSSModel(CONFIG, dtype=dtype, device=device)
    learner.load_state_dict(model.state_dict())
    return learner


@pytest.fixture(scope="module")
def learner():
    return make_learner()


def packed_logits(model, sequences: list[list[int]]) -> list[torch.Tensor]:
    """The learner's training forward: every sequence packed into one row (cu_seqlens), fp32 logits."""
    device = model.output_weight().device
    ids = torch.tensor([t for s in sequences for t in s], device=device)[None]
    positions = torch.cat([torch.arange(len(s)) for s in sequences]).to(device)[None]
    lengths = torch.tensor([len(s) for s in sequences])
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).int()]).to(device)
    with torch.no_grad():
        hidden = model.hidden_states(ids, positions, cu_seqlens=cu, max_seqlen=max(map(len, sequences)))
        logits = fp32_logits(hidden[0], model.output_weight())
    return list(logits.cpu().split(lengths.tolist()))


def learner_logprobs(model, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    """The learner's log-probs of `tokens` after `prompt` (packed forward of the one sequence)."""
    device = model.output_weight().device
    seq = torch.tensor(prompt + tokens, device=device)
    n = len(seq) - 1
    cu = torch.tensor([0, n], dtype=torch.int32, device=device)
    with torch.no_grad():
        hidden = model.hidden_states(
            seq[None, :-1], torch.arange(n, device=device)[None], cu_seqlens=cu, max_seqlen=n
        )
        lp = token_logprobs(hidden[0], model.output_weight(), seq[1:], temperature=temperature)
    return lp[len(prompt) - 1 :].cpu()


def generate_recording_logits(learner, prompts, params, **options):
    """The engine's outputs and, per sequence, {position: the fp32 logits it sampled from} (none where the
    decode graphs sample inside the graph)."""
    weight = learner.output_weight()
    engine = EmbeddedEngine(
        CONFIG, dtype=weight.dtype, device=weight.device, seed=0, options=EmbeddedEngineConfig(**options)
    )
    engine.update_weights(iter_hf_tensors(learner, CONFIG))
    seen: dict[int, dict[int, torch.Tensor]] = {}
    sample = engine._sample

    def recording(logits, seqs):
        for row, seq in enumerate(seqs):
            seen.setdefault(id(seq), {})[len(seq.tokens) - 1] = logits[row].cpu()
        return sample(logits, seqs)

    engine._sample = recording
    outs = engine.generate(prompts, params)
    return outs, list(seen.values())


def compare(learner, prompts, params, record_logits: bool, **options) -> list[bool]:
    """Per sampled token: whether the engine's logits (where recorded) and log-prob equal the learner's
    training forward bit for bit. Asserts that rows finish apart and every position was compared."""
    outs, recorded = generate_recording_logits(learner, prompts, params, **options)
    assert len({len(o.token_ids) for o in outs}) > 1  # rows finish apart
    train = packed_logits(learner, [p + o.token_ids for p, o in zip(prompts, outs)])
    same = []
    for prompt, out, logits in zip(prompts, outs, train):
        lp = learner_logprobs(learner, prompt, out.token_ids, params.temperature)
        same += [bool(a == b) for a, b in zip(torch.tensor(out.logprobs), lp)]
        if record_logits:
            steps = next(r for r in recorded if min(r) == len(prompt) - 1 and len(r) == len(out.token_ids))
            same += [torch.equal(engine_logits, logits[pos]) for pos, engine_logits in steps.items()]
    assert len(same) == (2 if record_logits else 1) * sum(len(o.token_ids) for o in outs)
    return same


PROMPTS = [
    torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 17, 6, 11, 1)
]
PARAMS = SamplingParams(temperature=0.8, max_new_tokens=9, stop_token_ids=[95, 65, 19], seed=7)  # stop apart
OPTIONS = dict(max_batch_slots=2, block_size=4, max_step_tokens=6)  # more prompts than slots, chunked prefill


def test_engine_logits_and_logprobs_equal_the_training_forward_bitwise(learner):
    with batch_invariant.enabled():
        assert all(compare(learner, PROMPTS, PARAMS, True, **OPTIONS))
    # without the mode the same comparison is not bitwise (the library GEMMs depend on the batch)
    assert not all(compare(learner, PROMPTS, PARAMS, True, **OPTIONS))
