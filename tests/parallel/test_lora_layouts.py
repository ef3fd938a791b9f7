"""LoRA under tensor (+ sequence), expert and pipeline parallelism on 2 gloo ranks against the
single-process model: two AdamW steps of the distributed optimizer (which holds the adapters only) on
packed micro-batches; the loss and gradient norm of each step, every adapter gradient of the first step,
every adapter after the second, the pipeline's log-probs after training, and the frozen base unchanged.
Adapters on every target (router included); B starts non-zero so every adapter gradient is non-zero."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers.harness import pool
from helpers.reference_learner import MasterWeightAdamW
from helpers.sharded import POOL_TIMEOUT, build_dims, reference_model, rel_err, tiny_config
from helpers.stages import build_stages
from test_layouts import BUDGET, DOCS, OPTIM, SEED, TEMPERATURE, batch_of, loss_of

from megatron_gptoss.config.lora import LORA_TARGETS, LoRAConfig
from megatron_gptoss.model.lora import is_adapter_param
from megatron_gptoss.parallel.data_parallel import DistributedOptimizer
from megatron_gptoss.parallel.pipeline import PipelineRunner
from megatron_gptoss.parallel.sharding import gather_full, get_shard
from megatron_gptoss.parallel.tensor_parallel import is_partial_over_tp
from megatron_gptoss.rl.ppo_loss import loss_denominators

LAYERS = 2
LORA = LoRAConfig(rank=2, alpha=3.0, targets=list(LORA_TARGETS))
VOCAB = 96


def lora_config():
    return tiny_config(num_layers=LAYERS, lora=LORA)


def reference(docs: list[list[list[int]]]) -> dict:
    model = reference_model(SEED, lora_config())
    opt = MasterWeightAdamW(list(model.parameters()), OPTIM, total_steps=len(docs))
    out: dict = {"loss": [], "grad_norm": []}
    for step in range(len(docs)):
        batches = [batch_of(step, d, lengths) for d, lengths in enumerate(docs[step])]
        tokens = int(sum(b["mask"].sum() for b in batches))
        loss = torch.zeros(())
        for b in batches:
            lp, ent = model.token_logprobs(model.hidden_states(b["input_ids"]), b["targets"])
            loss = loss + loss_of(lp, ent, b["mask"], tokens)
        loss.backward()
        out["loss"].append(loss.detach())
        if step == 0:
            out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        out["grad_norm"].append(opt.step()["train/grad_norm"])
        opt.zero_grad()
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        out["logprobs"] = []
        for d, lengths in enumerate(docs[-1]):
            b = batch_of(len(docs) - 1, d, lengths)
            lp, ent = model.token_logprobs(model.hidden_states(b["input_ids"]), b["targets"], TEMPERATURE)
            out["logprobs"].append((lp * b["valid"], ent * b["valid"]))
    return out


def run(parallel: dict, docs: list[list[list[int]]]) -> dict:
    config = lora_config()
    cfg, dims = build_dims(config, **parallel)
    models, plans = build_stages(config, dims, cfg)
    opt = DistributedOptimizer(models, OPTIM, dims, total_steps=len(docs))
    runner = PipelineRunner(models, plans, dims, chunk_size=16)
    replica = dims.coord("dp")
    out: dict = {"loss": [], "grad_norm": [], "replica": replica}
    out["trainable"] = sorted(n for m in models for n, p in m.named_parameters() if p.requires_grad)
    out["optimizer_params"] = sum(len(b.params) for b in opt.buckets)
    for step, per_replica in enumerate(docs):
        b = batch_of(step, replica, per_replica[replica])
        packed = runner.pack(b["input_ids"], b["targets"], b["valid"], BUDGET)
        tokens = loss_denominators([b["mask"]], dims.group("dp")).tokens

        def loss_fn(rows, lp, ent, mask=b["mask"], tokens=tokens):
            return loss_of(lp, ent, mask[rows], tokens)

        loss = runner.forward_backward(packed, loss_fn)
        dist.all_reduce(loss, group=dims.group("dp"))
        out["loss"].append(loss)
        if step == 0:
            out["grads"] = {}
            for m in models:
                for name, p in m.named_parameters():
                    if not p.requires_grad:
                        continue
                    g = p.main_grad.clone()
                    if is_partial_over_tp(p) and dims.tp > 1:
                        dist.all_reduce(g, group=dims.group("tp"))
                    dist.all_reduce(g, group=dims.group("edp" if ".mlp.experts." in name else "dp"))
                    out["grads"][name] = gather_full(g, get_shard(p), dims, VOCAB)
        out["grad_norm"].append(opt.step()["train/grad_norm"])
    out["params"] = {
        n: gather_full(p.detach(), get_shard(p), dims, VOCAB) for m in models for n, p in m.named_parameters()
    }
    out["logprobs"] = runner.logprobs(packed, TEMPERATURE)
    return out


LAYOUTS = {
    "tp2": {"tensor_model_parallel_size": 2},
    "tp2_sp": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
    "ep2": {"expert_model_parallel_size": 2},
    "pp2": {"pipeline_model_parallel_size": 2},
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lora_layout_equals_single_process(layout):
    parallel = LAYOUTS[layout]
    tp, pp = parallel.get("tensor_model_parallel_size", 1), parallel.get("pipeline_model_parallel_size", 1)
    docs = DOCS[2 // (tp * pp)]
    per_rank = pool(2).run(run, parallel, docs, timeout=POOL_TIMEOUT)
    ref = reference(docs)
    init = reference_model(SEED, lora_config())
    adapter_names = {n for n, _ in init.named_parameters() if is_adapter_param(n)}
    assert len(adapter_names) == 2 * len(LORA_TARGETS) * LAYERS
    worst: dict[str, float] = {}
    seen: set[str] = set()
    for rank, out in enumerate(per_rank):
        assert set(out["trainable"]) <= adapter_names and out["optimizer_params"] == len(out["trainable"])
        errs = {f"loss{s}": rel_err(x, ref["loss"][s]) for s, x in enumerate(out["loss"])}
        for s, norm in enumerate(out["grad_norm"]):
            errs[f"grad_norm{s}"] = rel_err(torch.tensor(norm), torch.tensor(ref["grad_norm"][s]))
        for name, g in out["grads"].items():
            assert bool(ref["grads"][name].abs().sum() > 0), name
            errs[f"grad:{name}"] = rel_err(g, ref["grads"][name])
        for name, p in out["params"].items():
            seen.add(name)
            if is_adapter_param(name):
                errs[f"param:{name}"] = rel_err(p, ref["params"][name])
                assert not torch.equal(p, dict(init.named_parameters())[name]), f"{name} did not train"
            else:  # frozen: exactly its initial value
                full = dict(init.named_parameters())[name]
                assert torch.equal(p, full[: p.shape[0]] if p.shape != full.shape else full), name
        lp, ent = out["logprobs"]
        ref_lp, ref_ent = ref["logprobs"][out["replica"]]
        errs["logprob"], errs["entropy"] = rel_err(lp, ref_lp), rel_err(ent, ref_ent)
        name, err = max(errs.items(), key=lambda kv: kv[1])
        assert err <= 1e-5, f"{layout} rank {rank}: {name} error {err:.3g}"
        worst[layout] = max(worst.get(layout, 0.0), err)
    assert seen == set(ref["params"]), sorted(set(ref["params"]) ^ seen)
    print(f"LoRA {layout}: worst error {worst[layout]:.2e}")
