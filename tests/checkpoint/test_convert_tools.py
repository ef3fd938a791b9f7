"""The conversion tools: HF -> sharded checkpoint of a layout -> HF, in one process.

- bf16: the round trip is bitwise for every tensor, config.json is the one `save_hf` writes, and
  transformers loads the result; the converted checkpoint (written for tp2 x pp2 x ep2 on 8 ranks) loads
  into a 4-rank tp2 x pp2 run bit for bit as `load_hf_parallel` reads the HF directory, the optimizer's
  master weights taken from the parameters.
- MXFP4: the round trip equals `load_hf`'s dequantized weights in bf16, bitwise.
- the save frees each piece once written (DCP keeps a reference to the last tensor of each name).
- errors: a layout that does not divide, a missing HF tensor, a missing shard, an existing output.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.harness import pool
from helpers.hf_checkpoints import write_mxfp4_checkpoint
from helpers.scripts import load_script, read_tensors
from helpers.sharded import build_dims, tiny_config

from megatron_gptoss.checkpoint.dist_boxes import Box
from megatron_gptoss.checkpoint.dist_convert import dist_to_hf, hf_to_dist
from megatron_gptoss.checkpoint.dist_planner import Piece, write_virtual_ranks
from megatron_gptoss.checkpoint.distributed import DistributedCheckpointer
from megatron_gptoss.checkpoint.manager import CheckpointManager
from megatron_gptoss.config import ConfigError, OptimConfig, ParallelConfig
from megatron_gptoss.errors import CheckpointError, CorruptCheckpointError
from megatron_gptoss.hf import iter_hf_tensors, load_hf, save_hf

TIMEOUT = 240.0
TP2_PP2_EP2 = ParallelConfig(
    tensor_model_parallel_size=2, pipeline_model_parallel_size=2, expert_model_parallel_size=2
)
OURS = {"make_vocab_size_divisible_by": 32}  # what config.json does not carry


def tiny_model(seed: int):
    from hf.test_hf import tiny_model  # imported here: the pool's ranks need not import transformers

    return tiny_model(seed=seed)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A tiny bf16 HF directory (several shards), its sharded checkpoint for tp2 x pp2 x ep2 on 8 ranks
    (small chunks, so tensors are cut into several pieces) and that checkpoint back in HF form, both
    through the command-line tools."""
    root = tmp_path_factory.mktemp("convert")
    save_hf(tiny_model(seed=3), root / "hf", max_shard_bytes=60_000)
    hf_args = [str(root / "hf"), str(root / "dist"), "--world", "8", "--tp", "2", "--pp", "2", "--ep", "2"]
    hf_args += ["--chunk-mb", "0", "--make-vocab-size-divisible-by", "32", "--no-progress"]
    to_dist = load_script("convert_hf_to_dist").main(hf_args)
    back = ["--shard-gb", str(40_000 / 2**30), "--block-mb", "0", "--verify", "--no-progress"]
    to_hf = load_script("convert_dist_to_hf").main([str(root / "dist"), str(root / "back"), *back])
    assert to_dist["bytes_written"] > 0 and to_hf["bytes_written"] > 0
    return root


def test_bf16_round_trip_is_bitwise_and_loads_in_transformers(converted):
    source, back = read_tensors(converted / "hf"), read_tensors(converted / "back")
    assert sorted(source) == sorted(back)
    for name, tensor in source.items():
        assert back[name].dtype == torch.bfloat16 and torch.equal(back[name], tensor), name
    assert json.loads((converted / "back" / "config.json").read_text()) == json.loads(
        (converted / "hf" / "config.json").read_text()
    )
    assert len(list((converted / "back").glob("*.safetensors"))) > 1
    assert sorted(p.name for p in (converted / "dist").glob("__*")) == [f"__{r}_0.distcp" for r in range(8)]
    from transformers import GptOssForCausalLM

    model = GptOssForCausalLM.from_pretrained(converted / "back", dtype=torch.bfloat16)
    state = model.state_dict()
    for name, tensor in source.items():
        key = name if name in state else name.removeprefix("model.")
        if name.endswith(("gate_up_proj", "down_proj")):  # transformers keeps our HF layout
            assert torch.equal(state[key], tensor), name


def test_mxfp4_round_trip_equals_the_dequantized_weights(tmp_path):
    source = write_mxfp4_checkpoint(tiny_model(seed=4), tmp_path / "mxfp4")
    hf_to_dist(
        source, tmp_path / "dist", ParallelConfig(expert_model_parallel_size=2), 2, **OURS, progress=False
    )
    dist_to_hf(tmp_path / "dist", tmp_path / "back", progress=False)
    model = load_hf(source, dtype=torch.bfloat16, **OURS)
    expected = dict(iter_hf_tensors(model, model.config))
    back = read_tensors(tmp_path / "back")
    assert sorted(back) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(back[name], tensor), name


def load_converted_case(path: str, hf: str) -> list[str]:
    """Load the converted checkpoint into tp2 x pp2 (another layout than it was written for); returns the
    parameters that differ from what load_hf_parallel reads from the HF directory."""
    from megatron_gptoss.parallel.apply import parallelize
    from megatron_gptoss.parallel.data_parallel import DistributedOptimizer
    from megatron_gptoss.parallel.loading import load_hf_parallel
    from megatron_gptoss.parallel.pipeline import build_stage_model, stage_plans

    config = tiny_config()
    cfg, dims = build_dims(config, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    plans = stage_plans(dims, config.num_layers)
    models = [parallelize(build_stage_model(config, plan), dims, cfg) for plan in plans]
    expected = [parallelize(build_stage_model(config, plan), dims, cfg) for plan in plans]
    load_hf_parallel(expected, hf, dims, config)
    opt = DistributedOptimizer(models, OptimConfig(), dims, total_steps=1)
    group = torch.distributed.new_group(backend="gloo")
    ckpt = DistributedCheckpointer(CheckpointManager(Path(path).parent), dims, config, group)
    loaded = ckpt.load(path, {"model": models}, opt)
    assert loaded.run.step == 0 and not loaded.same_layout
    want = {n: p for m in expected for n, p in m.named_parameters()}
    bad = [n for m in models for n, p in m.named_parameters() if not torch.equal(p, want[n])]
    buckets = zip(opt.buckets, opt.master)
    bad += [f"master {i}" for i, (b, m) in enumerate(buckets) if not torch.equal(b.data[b.lo : b.hi], m)]
    return bad


def test_converted_checkpoint_loads_into_another_layout(converted):
    per_rank = pool(4).run(
        load_converted_case, str(converted / "dist"), str(converted / "hf"), timeout=TIMEOUT
    )
    assert per_rank == [[]] * 4


def test_save_frees_each_piece_once_written(tmp_path):
    made: list[torch.Tensor] = []

    def make(i):
        def f():
            made.append(torch.full((4, 3), float(i)))
            return made[-1]

        return f

    pieces = [Piece("w", (8, 3), Box((4 * i, 0), (4, 3)), torch.float32, make(i)) for i in range(2)]
    write_virtual_ranks(tmp_path / "c", [(pieces[:1], {}), (pieces[1:], {})])
    assert len(made) == 2 and all(t.untyped_storage().nbytes() == 0 for t in made)


def test_errors_name_the_problem(converted, tmp_path):
    with pytest.raises(ConfigError, match="num_attention_heads=4 not divisible by tp=3"):
        hf_to_dist(converted / "hf", tmp_path / "x", ParallelConfig(tensor_model_parallel_size=3), 3, **OURS)
    with pytest.raises(ConfigError, match="world size 6 is not divisible"):
        hf_to_dist(
            converted / "hf", tmp_path / "x", ParallelConfig(pipeline_model_parallel_size=4), 6, **OURS
        )
    with pytest.raises(FileExistsError):
        hf_to_dist(converted / "hf", converted / "dist", ParallelConfig(), 1, **OURS)
    broken = tmp_path / "hf"
    save_hf(tiny_model(seed=3), broken)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.1.self_attn.sinks"]
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="missing tensor 'model.layers.1.self_attn.sinks'"):
        hf_to_dist(broken, tmp_path / "x", ParallelConfig(), 1, **OURS, progress=False)
    assert not list(tmp_path.glob(".x.partial*")) and not (tmp_path / "x").exists()
    with pytest.raises(CheckpointError, match="has no manifest.json"):
        dist_to_hf(converted / "hf", tmp_path / "y")
    partial = tmp_path / "dist"
    hf_to_dist(
        converted / "hf", partial, ParallelConfig(expert_model_parallel_size=2), 2, **OURS, progress=False
    )
    (partial / "__1_0.distcp").unlink()
    with pytest.raises(CorruptCheckpointError, match=r"missing: \['__1_0.distcp'\]"):
        dist_to_hf(partial, tmp_path / "y")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_expert_conversions_equal_the_reference_bit_for_bit(dtype):
    from megatron_gptoss.checkpoint.dist_experts import dequantize, experts_from_hf, experts_to_hf
    from megatron_gptoss.hf.mxfp4 import dequantize_mxfp4
    from megatron_gptoss.hf.names import from_hf, match_ours, to_hf

    # every byte under every scale (0: subnormal powers, 255: inf)
    blocks = torch.arange(256, dtype=torch.uint8).repeat(256, 1).reshape(256, 16, 16)
    scales = torch.arange(256, dtype=torch.uint8)[:, None].expand(256, 16).contiguous()
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(
        dequantize(blocks, scales, dtype).view(bits), dequantize_mxfp4(blocks, scales, dtype).view(bits)
    )
    config = tiny_config()
    gen = torch.Generator().manual_seed(0)
    for kind, shape in (("fc1", (4, 32, 64)), ("fc2", (4, 32, 32))):
        match = match_ours(f"decoder.layers.0.mlp.experts.linear_{kind}.weight")
        hf = torch.randn(shape, generator=gen).to(dtype)
        ours = experts_from_hf(kind, hf, dtype)
        assert torch.equal(ours, from_hf(match, [hf], config))
        assert torch.equal(experts_to_hf(kind, ours), to_hf(match, ours, config)[0][1])
