"""Whole layouts (pipeline stages, tensor / sequence / expert parallel, data parallel with the sharded
optimizer) against the single-process model: the loss and the global gradient norm of two AdamW
steps, every gradient of the first step (reduced over the data-parallel ranks, gathered to full
shape), every parameter after the second step, and the pipeline's log-probs and entropy after
training at a sampling temperature. Documents are packed into micro-batches of a fixed token budget,
and the data-parallel ranks hold different numbers of documents and loss tokens.

`run_layout` (run on every rank of a pool) and `reference_run` (in the test process) are the one
harness; test_pipeline and test_data_parallel use it for their layouts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from helpers.harness import pool
from helpers.reference_learner import MasterWeightAdamW
from helpers.sharded import build_dims, reference_model, rel_err, tiny_config
from helpers.stages import build_stages, full_params, reduced_full_grads
from torch import Tensor

from megatron_gptoss.config import OptimConfig
from megatron_gptoss.parallel.data_parallel import DistributedOptimizer
from megatron_gptoss.parallel.pipeline import PipelineRunner
from megatron_gptoss.rl.ppo_loss import loss_denominators

SEED = 0
VOCAB = 96
BUDGET = 32
ENTROPY_COEF = 0.1
TEMPERATURE = 0.7  # of the log-prob pass after training (the RL path: no loss, no graph)
# Document lengths per step and data-parallel rank (uneven counts; most longer than the window, 8).
DOCS = {
    1: [[[12, 20, 9, 17, 10]], [[25, 6, 14, 9, 19]]],
    2: [[[12, 20, 9], [17, 10]], [[25, 6, 14], [9, 19]]],
}
# Gradient norms are 1.5-2.5, so clipping engages. Adam normalises every element, which turns a
# gradient element's fp32 rounding error into a parameter error of order lr: 1e-3 keeps it below 1e-5.
OPTIM = OptimConfig(lr=1e-3, weight_decay=0.1, clip_grad=0.5)


def batch_of(step: int, replica: int, lengths: list[int]) -> dict[str, Tensor]:
    """Right-padded rows (one document each) of data-parallel `replica` at `step`."""
    gen = torch.Generator().manual_seed(1000 * step + replica)
    rows, width = len(lengths), max(lengths)
    valid = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    ids = torch.randint(0, VOCAB, (rows, width), generator=gen) * valid
    targets = torch.randint(0, VOCAB, (rows, width), generator=gen) * valid
    mask = ((torch.rand(rows, width, generator=gen) < 0.7) & valid).float()
    return {"input_ids": ids, "targets": targets, "valid": valid, "mask": mask}


def loss_of(logprobs: Tensor, entropy: Tensor, mask: Tensor, tokens: int) -> Tensor:
    """Token-mean negative log-likelihood minus an entropy bonus, over `tokens` loss tokens."""
    return -((logprobs * mask).sum() + ENTROPY_COEF * (entropy * mask).sum()) / tokens


def reference_run(layers: int, docs: list[list[list[int]]], steps: int = 2) -> dict:
    """The single-process model on all replicas' documents: losses, first-step gradients, parameters
    after the last step, log-probs of every replica's last batch after training."""
    config = tiny_config(num_layers=layers)
    model = reference_model(SEED, config)
    opt = MasterWeightAdamW(list(model.parameters()), OPTIM, total_steps=steps)
    out: dict = {"loss": []}
    for step in range(steps):
        batches = [batch_of(step, d, lengths) for d, lengths in enumerate(docs[step])]
        tokens = int(sum(b["mask"].sum() for b in batches))
        loss = torch.zeros(())
        for b in batches:
            hidden = model.hidden_states(b["input_ids"])
            lp, ent = model.token_logprobs(hidden, b["targets"])
            loss = loss + loss_of(lp, ent, b["mask"], tokens)
        loss.backward()
        out["loss"].append(loss.detach())
        if step == 0:
            out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
        out.setdefault("grad_norm", []).append(opt.step()["train/grad_norm"])
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        out["logprobs"] = []
        for b in (batch_of(steps - 1, d, lengths) for d, lengths in enumerate(docs[steps - 1])):
            lp, ent = model.token_logprobs(model.hidden_states(b["input_ids"]), b["targets"], TEMPERATURE)
            out["logprobs"].append((lp * b["valid"], ent * b["valid"]))
    return out


def run_layout(parallel: dict, layers: int, docs: list[list[list[int]]], options: dict) -> dict:
    """Two optimizer steps of the parallel model on this rank's documents; returns what `compare`
    checks (full-shape tensors of this rank's stages). `options`: `counts` (layers per stage),
    `shard` (distributed optimizer, default True) and `dtype` (parameters, default float32)."""
    config = tiny_config(num_layers=layers)
    cfg, dims = build_dims(config, **parallel)
    models, plans = build_stages(config, dims, cfg, options.get("counts"))
    models = [m.to(getattr(torch, options.get("dtype", "float32"))) for m in models]
    opt = DistributedOptimizer(models, OPTIM, dims, total_steps=len(docs), shard=options.get("shard", True))
    runner = PipelineRunner(models, plans, dims, chunk_size=16)
    replica = dims.coord("dp")
    out: dict = {"loss": [], "replica": replica, "metrics": []}
    for step, per_replica in enumerate(docs):
        b = batch_of(step, replica, per_replica[replica])
        packed = runner.pack(b["input_ids"], b["targets"], b["valid"], BUDGET)
        tokens = loss_denominators([b["mask"]], dims.group("dp")).tokens
        mask = b["mask"]

        def loss_fn(rows, lp, ent, mask=mask, tokens=tokens):
            return loss_of(lp, ent, mask[rows], tokens)

        loss = runner.forward_backward(packed, loss_fn)
        dist.all_reduce(loss, group=dims.group("dp"))
        out["loss"].append(loss)
        out.setdefault("micro_batches", []).append(packed.num_micro_batches)
        if step == 0:
            out["grads"] = reduced_full_grads(models, dims)
        out["metrics"].append(opt.step())
    out["params"] = full_params(models, dims)
    out["logprobs"] = runner.logprobs(packed, TEMPERATURE)
    out["optimizer"] = optimizer_summary(opt)
    return out


def optimizer_summary(opt: DistributedOptimizer) -> dict:
    """Dtypes, sizes and the agreement of parameters with this rank's fp32 master shard."""
    return {
        "param_dtypes": sorted({str(b.data.dtype) for b in opt.buckets}),
        "grad_dtypes": sorted({str(b.grad.dtype) for b in opt.buckets}),
        "master_dtypes": sorted({str(m.dtype) for m in opt.master}),
        "master_elements": sum(m.numel() for m in opt.master),
        "buffer_elements": sum(b.data.numel() for b in opt.buckets),
        "params_equal_master": all(
            torch.equal(b.data[b.lo : b.hi], m.to(b.data.dtype)) for b, m in zip(opt.buckets, opt.master)
        ),
    }


def compare(per_rank: list[dict], ref: dict, tol: float | dict[str, float] = 1e-5) -> dict[str, float]:
    """Worst error per kind over all ranks (asserting each <= tol, or tol[kind] when a dict: a kind
    missing from it is not checked); every reference parameter must be covered by some rank."""
    limits = (
        tol
        if isinstance(tol, dict)
        else dict.fromkeys(("loss", "grad_norm", "grad", "param", "logprob"), tol)
    )
    worst = {"loss": 0.0, "grad_norm": 0.0, "grad": 0.0, "param": 0.0, "logprob": 0.0}
    seen: set[str] = set()
    for rank, out in enumerate(per_rank):
        errs = {f"loss{s}": ("loss", rel_err(x, ref["loss"][s])) for s, x in enumerate(out["loss"])}
        for s, metrics in enumerate(out["metrics"]):
            norm, ref_norm = torch.tensor(metrics["train/grad_norm"]), torch.tensor(ref["grad_norm"][s])
            errs[f"grad_norm{s}"] = ("grad_norm", rel_err(norm, ref_norm))
        for name, g in out["grads"].items():
            errs[f"grad:{name}"] = ("grad", rel_err(g, _real(ref["grads"][name], name)))
        for name, p in out["params"].items():
            errs[f"param:{name}"] = ("param", rel_err(p, _real(ref["params"][name], name)))
            seen.add(name)
        lp, ent = out["logprobs"]
        ref_lp, ref_ent = ref["logprobs"][out["replica"]]
        errs["logprob"] = ("logprob", rel_err(lp, ref_lp))
        errs["entropy"] = ("logprob", rel_err(ent, ref_ent))
        for name, (kind, err) in errs.items():
            limit = limits.get(kind, float("inf"))
            assert err <= limit, f"rank {rank}: {name} error {err:.3g} > {limit}"
            worst[kind] = max(worst[kind], err)
    assert seen == set(ref["params"]), sorted(set(ref["params"]) - seen)
    return worst


def _real(t: Tensor, name: str) -> Tensor:
    return t[:VOCAB] if name in ("embedding.word_embeddings.weight", "output_layer.weight") else t


def check_layout(
    world: int, parallel: dict, layers: int = 4, tol: float | dict[str, float] = 1e-5, **kwargs
) -> list[dict]:
    """Run the layout on a pool of `world` ranks and compare with the single-process run; returns the
    per-rank results."""
    tp, pp = parallel.get("tensor_model_parallel_size", 1), parallel.get("pipeline_model_parallel_size", 1)
    docs = DOCS[world // (tp * pp)]
    per_rank = pool(world).run(run_layout, parallel, layers, docs, kwargs)
    worst = compare(per_rank, reference_run(layers, docs), tol)
    print(f"{parallel} {kwargs}: worst errors {worst}; micro-batches {per_rank[0]['micro_batches']}")
    return per_rank


# ------------------------------------------------------------------------------------------------
def test_tp2_sp_pp2_equals_single_process():
    check_layout(
        4, {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "sequence_parallel": True}
    )


def test_tp2_ep2_pp2_equals_single_process():
    parallel = {
        "tensor_model_parallel_size": 2,
        "expert_model_parallel_size": 2,
        "pipeline_model_parallel_size": 2,
    }
    check_layout(8, parallel)


def test_dp2_ep2_pp2_interleaved_equals_single_process():
    # ep spans the two data-parallel pipelines: they run the same number of micro-batches.
    parallel = {
        "expert_model_parallel_size": 2,
        "pipeline_model_parallel_size": 2,
        "virtual_pipeline_model_parallel_size": 2,
    }
    check_layout(4, parallel)
