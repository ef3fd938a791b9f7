"""Pipeline stages and schedules: the layer split, packing of documents into micro-batches, and pp2
with the 1F1B and the interleaved schedule (uneven stages) against the single-process model."""

import pytest
import torch
from test_layouts import check_layout

from megatron_gptoss.config import ConfigError
from megatron_gptoss.parallel.pipeline import cu_seqlens_from_positions, pack_micro_batches, split_layers


def test_split_layers_even_uneven_and_explicit():
    assert split_layers(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    # the remainder goes to the middle stages, then the last, then the first
    assert [len(r) for r in split_layers(10, 4)] == [2, 3, 3, 2]
    assert [len(r) for r in split_layers(11, 4)] == [2, 3, 3, 3]
    assert [len(r) for r in split_layers(36, 5)] == [7, 8, 7, 7, 7]
    assert split_layers(5, 3, [0, 4, 1]) == [range(0, 0), range(0, 4), range(4, 5)]
    with pytest.raises(ConfigError, match="sum to 4"):
        split_layers(5, 2, [1, 3])
    with pytest.raises(ConfigError, match="middle stage"):
        split_layers(4, 3, [2, 0, 2])


def test_packing_round_trip_and_document_boundaries():
    lengths = [5, 9, 3, 0, 7]
    width = max(lengths)
    valid = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    ids = torch.arange(len(lengths) * width).view(len(lengths), width) * valid
    packed = pack_micro_batches(ids, ids + 1000, valid, token_budget=12, multiple_of=2)
    assert packed.num_micro_batches == 4  # [5], [9, 3], [7] and a filler-only one
    assert [r.tolist() for r in packed.rows] == [[0], [1, 2], [4], []]
    assert torch.equal(packed.unpack(packed.input_ids), ids)
    assert torch.equal(packed.unpack(packed.targets), (ids + 1000) * valid)
    cu, longest = cu_seqlens_from_positions(packed.positions[1])
    assert cu.tolist() == [0, 9, 12] and longest == 9
    cu, longest = cu_seqlens_from_positions(packed.positions[0])
    assert cu.tolist() == [0, 5, 12] and longest == 7  # the filler is a document of its own
    rows = packed.micro_rows(1, packed.targets[1].float())
    assert torch.equal(rows, ((ids + 1000) * valid)[[1, 2]].float())
    with pytest.raises(ValueError, match="more than the micro-batch token budget 8"):
        pack_micro_batches(ids, ids, valid, token_budget=8)


def test_pp2_1f1b_uneven_stages_equals_single_process():
    check_layout(2, {"pipeline_model_parallel_size": 2}, layers=4, counts=[1, 3])


def test_pp2_interleaved_virtual_stages_equals_single_process():
    # 5 layers over 4 virtual stages: [1, 2, 1, 1]; rank 0 holds stages 0 and 2, rank 1 stages 1 and 3
    check_layout(2, {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}, layers=5)
