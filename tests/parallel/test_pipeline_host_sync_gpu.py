"""On a GPU: the pp = 1 training step (forward, the loss with its metrics, backward) of a tiny bf16 model
on the Triton attention makes no synchronizing CUDA call, checked with torch's sync debug mode set to
raise; the step before it (warm-up: kernel compilation, allocator growth) is not checked."""

import pytest
import torch
import torch.distributed as dist

from megatron_gptoss.config import ParallelConfig, gpt_oss_tiny
from megatron_gptoss.model import build_model
from megatron_gptoss.parallel.dims import ParallelDims
from megatron_gptoss.parallel.pipeline import PipelineRunner, StagePlan
from megatron_gptoss.rl.learner import MetricTotals
from megatron_gptoss.utils.host import to_device

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_training_step_makes_no_host_sync(tmp_path):
    device = torch.device("cuda")
    config = gpt_oss_tiny(attention_backend="triton")
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        dims = ParallelDims.build(ParallelConfig(), config)
        model = build_model(config, dtype=torch.bfloat16, device=device, seed=1)
        runner = PipelineRunner([model], [StagePlan(0, 1, range(config.num_layers))], dims)
        gen = torch.Generator().manual_seed(2)
        lengths = torch.tensor([40, 17, 33, 9])
        valid = torch.arange(48)[None, :] < lengths[:, None]
        ids = torch.randint(0, config.vocab_size, valid.shape, generator=gen) * valid
        targets = torch.randint(0, config.vocab_size, valid.shape, generator=gen) * valid
        packed = runner.pack(ids, targets, valid, 64)
        mask = valid.float()
        totals = MetricTotals()

        def loss_fn(rows, lp, ent):
            m = to_device(mask[rows], lp.device)
            loss = -(lp * m).sum() / 99.0
            totals.add({"loss/total": loss.detach(), "pg/tokens": m.sum(), "actor/entropy": ent.mean()})
            return loss

        runner.forward_backward(packed, loss_fn)  # warm-up
        torch.cuda.synchronize()
        model.zero_grad(set_to_none=True)
        totals = MetricTotals()
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss = runner.forward_backward(packed, loss_fn)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.isfinite(loss) and totals.result()["pg/tokens"] == float(lengths.sum())
        assert all(p.grad is not None for p in model.parameters())
    finally:
        dist.destroy_process_group()
