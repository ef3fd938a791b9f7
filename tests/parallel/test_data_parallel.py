"""Data parallelism on 2 gloo ranks: gradients summed over ranks holding different numbers of documents
and loss tokens (token-mean over the whole mini-batch), the distributed optimizer (ZeRO-1) and the
replicated one, bf16 parameters with fp32 gradients and master weights, and the skipped step on a
non-finite gradient."""

import copy
import logging

import torch
from helpers.harness import pool
from helpers.sharded import build_dims, tiny_config
from helpers.stages import build_stages, full_params
from test_layouts import BUDGET, DOCS, OPTIM, batch_of, check_layout, loss_of

from megatron_gptoss.parallel.data_parallel import DistributedOptimizer, grad_group
from megatron_gptoss.parallel.pipeline import PipelineRunner
from megatron_gptoss.rl.ppo_loss import loss_denominators


def test_grad_groups_by_name():
    assert grad_group("decoder.layers.3.mlp.experts.linear_fc1.weight") == "edp"
    assert grad_group("decoder.layers.3.mlp.router.weight") == "dp_cp"
    assert grad_group("embedding.word_embeddings.weight") == "dp_cp"


def test_dp2_sharded_optimizer_equals_single_process():
    per_rank = check_layout(2, {})
    for out in per_rank:
        summary = out["optimizer"]
        # each rank keeps the master weights and moments of half of every (padded) buffer
        assert summary["master_elements"] * 2 == summary["buffer_elements"]
        assert summary["params_equal_master"]
    # rank 1's documents fit one micro-batch of 32 tokens; it runs a filler one to match rank 0
    assert per_rank[0]["micro_batches"] == per_rank[1]["micro_batches"] == [2, 2]


def test_dp2_replicated_optimizer_equals_single_process():
    per_rank = check_layout(2, {}, shard=False)
    assert all(out["optimizer"]["master_elements"] == out["optimizer"]["buffer_elements"] for out in per_rank)


def test_dp2_bf16_parameters_fp32_gradients_and_master():
    # bf16 forward and backward against the fp32 single-process run: the loss, log-probs and parameters
    # agree to bf16 precision (gradients of a bf16 backward differ by percents and are not compared)
    tol = {"loss": 1e-2, "logprob": 2e-2, "param": 1e-2}
    per_rank = check_layout(2, {}, tol=tol, dtype="bfloat16")
    for out in per_rank:
        summary = out["optimizer"]
        assert summary["param_dtypes"] == ["torch.bfloat16"]
        assert summary["grad_dtypes"] == summary["master_dtypes"] == ["torch.float32"]
        assert summary["params_equal_master"]


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _non_finite_step() -> dict:
    config = tiny_config(num_layers=2)
    cfg, dims = build_dims(config)
    models, plans = build_stages(config, dims, cfg)
    opt = DistributedOptimizer(models, OPTIM, dims, total_steps=2)
    runner = PipelineRunner(models, plans, dims)
    handler = _Lines()
    logging.getLogger("megatron_gptoss.parallel.data_parallel").addHandler(handler)
    out = {}
    for step, poison in enumerate((True, False)):
        b = batch_of(0, dims.rank, DOCS[2][0][dims.rank])
        tokens = loss_denominators([b["mask"]], dims.group("dp")).tokens
        packed = runner.pack(b["input_ids"], b["targets"], b["valid"], BUDGET)

        def loss_fn(rows, lp, ent, mask=b["mask"], tokens=tokens):
            return loss_of(lp, ent, mask[rows], tokens)

        runner.forward_backward(packed, loss_fn)
        if poison and dims.rank == 1:
            models[0].decoder.layers["1"].mlp.router.weight.main_grad[0, 0] = float("inf")
        before = full_params(models, dims)
        master = [m.clone() for m in opt.master]
        metrics = opt.step()
        after = full_params(models, dims)
        out[step] = {
            "skipped": metrics["train/skipped"],
            "params_unchanged": all(torch.equal(before[n], after[n]) for n in before),
            "master_unchanged": all(torch.equal(a, b) for a, b in zip(master, opt.master)),
            "grads_zero": all(float(b.grad.abs().sum()) == 0 for b in opt.buckets),
            "step_count": opt.step_count,
        }
    out["log"] = handler.lines
    return out


def test_non_finite_gradient_on_one_rank_skips_the_step_on_all():
    for out in pool(2).run(_non_finite_step):
        assert out[0] == {
            "skipped": 1.0,
            "params_unchanged": True,
            "master_unchanged": True,
            "grads_zero": True,
            "step_count": 0,
        }
        assert out[1]["skipped"] == 0.0 and not out[1]["params_unchanged"] and out[1]["step_count"] == 1
        assert len(out["log"]) == 1 and "step 0 skipped: non-finite gradient norm inf" in out["log"][0]


def _resume() -> dict:
    """Two steps, then the second again after restoring the state saved after the first."""
    config = tiny_config(num_layers=2)
    cfg, dims = build_dims(config)
    models, plans = build_stages(config, dims, cfg)
    opt = DistributedOptimizer(models, OPTIM, dims, total_steps=2)
    runner = PipelineRunner(models, plans, dims)

    def train(step: int) -> None:
        b = batch_of(step, dims.rank, DOCS[2][step][dims.rank])
        tokens = loss_denominators([b["mask"]], dims.group("dp")).tokens
        packed = runner.pack(b["input_ids"], b["targets"], b["valid"], BUDGET)

        def loss_fn(rows, lp, ent, mask=b["mask"], tokens=tokens):
            return loss_of(lp, ent, mask[rows], tokens)

        runner.forward_backward(packed, loss_fn)
        opt.step()

    train(0)
    saved, after_first = copy.deepcopy(opt.state_dict()), full_params(models, dims)
    train(1)
    after_second = full_params(models, dims)
    opt.load_state_dict(saved)
    restored = full_params(models, dims)
    train(1)
    again = full_params(models, dims)
    return {
        "restored": all(torch.equal(restored[n], after_first[n]) for n in restored),
        "same_second_step": all(torch.equal(again[n], after_second[n]) for n in again),
        "step_count": opt.step_count,
    }


def test_optimizer_state_resumes_bit_for_bit():
    for out in pool(2).run(_resume):
        assert out == {"restored": True, "same_second_step": True, "step_count": 2}
