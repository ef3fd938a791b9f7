"""Bitwise on-policy mode at parallel layouts on two GPUs (NCCL, bf16): the embedded engine's log-prob of
every sampled token equals the learner's packed training forward bit for bit at tp2 with sequence parallel
(LoRA too) and at ep2, and not without the mode (the cases of tests/rl/test_bitwise_layouts.py)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_bitwise_layouts import LAYOUTS, full_state, on_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]


def _worker(rank: int, init: str, out: str, layout: str, state: dict[str, torch.Tensor]) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init}", rank=rank, world_size=2)
    try:
        result = {
            str(mode): on_ranks(layout, mode, state, f"cuda:{rank}", torch.bfloat16) for mode in (True, False)
        }
        with open(f"{out}.{rank}", "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("layout", ["tp2-sp", "tp2-lora", "ep2"])
def test_engine_logprobs_equal_the_learner_bitwise_on_two_gpus(tmp_path, layout):
    state = full_state(LAYOUTS[layout][0])
    out = str(tmp_path / "result")
    mp.spawn(_worker, args=(str(tmp_path / "pg"), out, layout, state), nprocs=2, join=True)
    ranks = [json.loads(open(f"{out}.{r}").read()) for r in range(2)]
    assert all(all(r["True"]) and r["True"] for r in ranks), ranks
    assert not all(all(r["False"]) for r in ranks), ranks
