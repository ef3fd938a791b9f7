"""Sleep and wake of an engine holding MXFP4 experts: the uint8 blocks and scales are weights like the
parameters (level 2 releases them, wake gives them back zeroed and update_weights refills them), except where
shared with a learner."""

import dataclasses

import pytest
import torch
from helpers.embedded_engine import CONFIG

from megatron_gptoss.config import EmbeddedEngineConfig
from megatron_gptoss.errors import EngineError
from megatron_gptoss.hf.mxfp4 import quantize_mxfp4
from megatron_gptoss.model.mxfp4_weight import mxfp4_weights
from megatron_gptoss.rollout import EmbeddedEngine, SamplingParams

MXFP4 = dataclasses.replace(CONFIG, expert_format="mxfp4")


def mxfp4_engine() -> EmbeddedEngine:
    engine = EmbeddedEngine(MXFP4, seed=0, options=EmbeddedEngineConfig(max_batch_slots=2, block_size=4))
    gen = torch.Generator().manual_seed(3)
    for weight in mxfp4_weights(engine.model).values():
        weight.copy_packed_(*quantize_mxfp4(0.1 * torch.randn(weight.shape, generator=gen)))
    engine.memory.weights_loaded()
    return engine


def packed_bytes(engine) -> dict[str, torch.Tensor]:
    return {f"{n}.{part}": getattr(w, part).clone() for n, w in mxfp4_weights(engine.model).items()
            for part in ("blocks", "scales")}  # fmt: skip


def test_level_2_releases_the_mxfp4_buffers_and_wake_returns_them_zeroed():
    engine = mxfp4_engine()
    params = SamplingParams(max_new_tokens=4, seed=5)
    before = engine.generate([[1, 2, 3]], params)
    packed = packed_bytes(engine)
    weights = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    expected = sum(p.numel() * p.element_size() for p in weights.values())
    expected += sum(t.numel() for t in packed.values())  # uint8
    released = engine.sleep(2)
    assert released["weight_bytes"] == expected
    assert all(getattr(w, part).numel() == 0 for w in mxfp4_weights(engine.model).values()
               for part in ("blocks", "scales"))  # fmt: skip
    engine.wake_up()
    with pytest.raises(EngineError, match="update_weights"):
        engine.generate([[1]], params)
    for name, weight in mxfp4_weights(engine.model).items():
        assert weight.blocks.dtype == torch.uint8 and not weight.blocks.any() and not weight.scales.any()
        weight.copy_packed_(packed[f"{name}.blocks"], packed[f"{name}.scales"])
    with torch.no_grad():  # the parameters came back zeroed too: restore them as they were
        for name, p in engine.model.named_parameters():
            p.copy_(weights[name])
    engine.memory.weights_loaded()  # what update_weights records
    after = engine.generate([[1, 2, 3]], params)
    assert after[0].token_ids == before[0].token_ids
