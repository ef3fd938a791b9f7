"""Exports from tp2, ep2, pp2 and tp2 x ep2 x pp2 learners on gloo are bit for bit the single-process export
(whole expert tensors, and expert slices rejoined), and each rank's peak extra memory stays within the
bound `bridge.export` states: one bucket on dst plus the transfers in flight, far below the model."""

import pytest
import torch
from helpers.bridge_layouts import LAYOUTS, export_layout, measure_layout
from helpers.vllm_checks import seeded_learner, train_steps, vllm_tiny_config

from megatron_gptoss.bridge.export import WeightExporter
from megatron_gptoss.bridge.plan import EngineLayout
from megatron_gptoss.config import gpt_oss_tiny
from megatron_gptoss.engine_api.protocol import parse_expert_slice

CONFIG = vllm_tiny_config()
BUCKET = 32 * 1024


@pytest.fixture(scope="module")
def learner():
    model = seeded_learner(CONFIG, seed=3)
    train_steps(model, steps=2, seed=3)
    return model


def rejoined(pairs) -> dict[str, torch.Tensor]:
    """Expert slices concatenated back into their whole tensors."""
    whole: dict[str, torch.Tensor] = {}
    pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for name, tensor in pairs:
        sliced = parse_expert_slice(name)
        if sliced is None:
            whole[name] = tensor
        else:
            pieces.setdefault(sliced[0], []).append((sliced[1], tensor))
    for name, parts in pieces.items():
        whole[name] = torch.cat([t for _, t in sorted(parts, key=lambda p: p[0])])
    return whole


@pytest.mark.parametrize("slices", [False, True], ids=["whole", "slices"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_export_is_bitwise_the_single_process_export(learner, layout, slices):
    engine = EngineLayout(expert_slices=slices)
    reference = list(WeightExporter([learner], CONFIG, None, engine, BUCKET).pairs())
    exported = export_layout(layout, CONFIG, learner, engine, BUCKET)
    if not slices or "ep" not in layout:  # the same stream, in the same order
        assert [n for n, _ in exported] == [n for n, _ in reference]
    ours, ref = rejoined(exported), rejoined(reference)
    assert sorted(ours) == sorted(ref)
    for name, tensor in ref.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), (layout, name)


MEMORY_CONFIG = gpt_oss_tiny(
    vocab_size=1024, hidden_size=256, intermediate_size=256, head_dim=64, num_layers=4, num_experts=8
)


@pytest.mark.parametrize("layout", ["tp2xep2xpp2"])
def test_peak_extra_memory_per_rank_is_bounded_by_the_bucket(layout):
    bucket = 1 << 20
    model_bytes = 4 * MEMORY_CONFIG.param_counts()["total"]
    per_rank = measure_layout(layout, MEMORY_CONFIG, EngineLayout(expert_slices=True), bucket)
    slack = 2 << 20  # allocator and gloo bookkeeping
    for m in per_rank:
        bound = (bucket if m["rank"] == 0 else 0) + 3 * m["largest_rooted"] + slack
        print(f"{layout} rank {m['rank']}: peak {m['peak'] / 2**20:.2f} MiB, bound {bound / 2**20:.2f} MiB")
        assert m["peak"] <= bound, m
    assert bucket + 3 * max(m["largest_rooted"] for m in per_rank) + slack < model_bytes / 4, model_bytes
