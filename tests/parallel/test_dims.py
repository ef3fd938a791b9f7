"""Layout arithmetic (no processes) and group construction on gloo."""

import pytest
from helpers.harness import pool

from megatron_gptoss.config import ConfigError, ParallelConfig, gpt_oss_tiny
from megatron_gptoss.parallel.dims import Layout, ParallelDims, validate_layout


def test_groups_partition_the_world_and_match_coords():
    layout = Layout(world=8, tp=2, pp=2, ep=2)
    groups = layout.groups()
    for kind, size in (("tp", 2), ("dp", 2), ("pp", 2), ("ep", 2), ("edp", 2), ("mp", 4)):
        flat = sorted(r for g in groups[kind] for r in g)
        assert flat == list(range(8)), kind
        assert all(len(g) == size for g in groups[kind]), kind
    assert groups["tp"][:2] == [[0, 1], [2, 3]] and groups["pp"][0] == [0, 4]
    for rank in range(8):
        c = layout.coords(rank)
        assert rank == c["tp"] + 2 * (c["dp"] + 2 * c["pp"])
        ep_group = next(g for g in groups["ep"] if rank in g)
        assert ep_group.index(rank) == c["ep"]


@pytest.mark.parametrize(
    "overrides,parallel,world,message",
    [
        (
            {"num_attention_heads": 6, "num_query_groups": 3},
            {"tensor_model_parallel_size": 2},
            2,
            "num_query_groups",
        ),
        (
            {"num_attention_heads": 3, "num_query_groups": 1},
            {"tensor_model_parallel_size": 2},
            2,
            "num_attention_heads",
        ),
        ({"num_experts": 3, "moe_router_topk": 2}, {"expert_model_parallel_size": 2}, 2, "num_experts=3"),
        ({}, {"pipeline_model_parallel_size": 4}, 4, "num_layers=2"),
        ({}, {"tensor_model_parallel_size": 2}, 3, "world size 3"),
        ({}, {"expert_model_parallel_size": 4}, 2, "expert_model_parallel_size=4"),
    ],
)
def test_invalid_layouts_name_the_numbers(overrides, parallel, world, message):
    with pytest.raises(ConfigError, match=message):
        validate_layout(ParallelConfig(**parallel), gpt_oss_tiny(**overrides), world)


def _build_and_report(tp, pp, ep):
    import torch.distributed as dist

    dims = ParallelDims.build(
        ParallelConfig(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep
        ),
        gpt_oss_tiny(num_layers=2),
    )
    out = {}
    for kind in ("tp", "dp", "pp", "ep", "edp"):
        ranks = [None] * dist.get_world_size(dims.group(kind))
        dist.all_gather_object(ranks, dims.rank, group=dims.group(kind))
        out[kind] = ranks
    return out


def test_process_groups_on_gloo():
    results = pool(4).run(_build_and_report, 2, 1, 2)
    layout = Layout(world=4, tp=2, pp=1, ep=2)
    for rank, got in enumerate(results):
        for kind, ranks in got.items():
            expected = next(g for g in layout.groups()[kind] if rank in g)
            assert ranks == expected, (rank, kind)
