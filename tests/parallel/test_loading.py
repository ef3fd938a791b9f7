"""An HF checkpoint (bf16, or MXFP4 experts) loaded straight into a parallel layout, every rank reading
only its slices, equals the single-process model sharded through the ShardSpec tags, bit for bit."""

from pathlib import Path

import pytest
import torch
from helpers.harness import pool
from helpers.hf_checkpoints import write_mxfp4_checkpoint
from helpers.sharded import build_dims, reference_model, tiny_config

from megatron_gptoss.errors import CheckpointError
from megatron_gptoss.hf import load_hf, save_hf
from megatron_gptoss.parallel.apply import parallelize
from megatron_gptoss.parallel.dims import Layout, ParallelDims
from megatron_gptoss.parallel.loading import init_parallel, load_hf_parallel, materialize
from megatron_gptoss.parallel.pipeline import StagePlan, build_stage_model, stage_plans
from megatron_gptoss.parallel.sharding import gather_full, get_shard, local_shard

LAYERS = 4


def _meta_stages(config, dims, cfg):
    """This rank's parallelised stage models, built on the meta device and allocated uninitialised."""
    models = []
    for plan in stage_plans(dims, config.num_layers):
        model = parallelize(build_stage_model(config, plan, device="meta"), dims, cfg)
        materialize(model, "cpu")
        models.append(model)
    return models


def _load_case(parallel: dict, path: str, total_bytes: int) -> dict:
    config = tiny_config(num_layers=LAYERS)
    cfg, dims = build_dims(config, **parallel)
    models = _meta_stages(config, dims, cfg)
    stats = load_hf_parallel(models, path, dims, config)
    expected = dict(load_hf(path, attention_backend="eager").named_parameters())
    padded = config.padded_vocab_size(dims.tp)
    mismatched = [
        name
        for model in models
        for name, p in model.named_parameters()
        if not torch.equal(p, local_shard(expected[name], get_shard(p), dims, padded))
    ]
    names = sum(len(list(m.parameters())) for m in models)
    return {
        "mismatched": mismatched,
        "tensors": stats["tensors"],
        "names": names,
        "share": stats["bytes_read"] / total_bytes,
    }


def _checkpoint_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    ref = reference_model(0, tiny_config(num_layers=LAYERS))
    return {"bf16": save_hf(ref, root / "bf16"), "mxfp4": write_mxfp4_checkpoint(ref, root / "mxfp4")}


@pytest.mark.parametrize(
    "world,parallel,fmt,max_share",
    [
        (
            4,
            {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "sequence_parallel": True},
            "bf16",
            0.5,
        ),
        (
            8,
            {
                "tensor_model_parallel_size": 2,
                "expert_model_parallel_size": 2,
                "pipeline_model_parallel_size": 2,
            },
            "bf16",
            0.35,
        ),
        (
            8,
            {
                "tensor_model_parallel_size": 2,
                "expert_model_parallel_size": 2,
                "pipeline_model_parallel_size": 2,
            },
            "mxfp4",
            0.35,
        ),
    ],
)
def test_hf_checkpoint_loads_into_layout_as_sharding_the_model(checkpoints, world, parallel, fmt, max_share):
    path = checkpoints[fmt]
    per_rank = pool(world).run(_load_case, parallel, str(path), _checkpoint_bytes(path))
    for rank, out in enumerate(per_rank):
        assert out["mismatched"] == [], f"rank {rank}"
        assert out["tensors"] == out["names"]
        # each rank reads its slices only
        assert out["share"] <= max_share, f"rank {rank} read {out['share']:.0%} of the checkpoint"
    print(f"{fmt} {parallel}: largest share read by a rank {max(o['share'] for o in per_rank):.0%}")


def test_missing_tensor_and_wrong_shape_name_the_tensor(tmp_path):
    config = tiny_config(num_layers=2)
    path = save_hf(reference_model(0, config), tmp_path / "ok")
    dims = ParallelDims(Layout(world=1, tp=1, pp=1, ep=1), rank=0)
    whole = StagePlan(0, 1, range(2))
    model = build_stage_model(config, whole)
    assert load_hf_parallel([model], path, dims, config)["tensors"] == len(list(model.parameters()))
    wider = tiny_config(num_layers=2, hidden_size=64)
    with pytest.raises(CheckpointError, match=r"model.embed_tokens.weight.*shape \(96, 32\).*\(96, 64\)"):
        load_hf_parallel([build_stage_model(wider, whole)], path, dims, wider)
    index = path / "model.safetensors.index.json"
    index.write_text(index.read_text().replace('"model.layers.1.self_attn.k_proj.weight"', '"renamed"'))
    with pytest.raises(CheckpointError, match="missing tensor 'model.layers.1.self_attn.k_proj.weight'"):
        load_hf_parallel([model], path, dims, config)


def _init_case(parallel: dict) -> dict:
    config = tiny_config(num_layers=LAYERS, router_init_std=0.3, output_init_std=0.1)
    cfg, dims = build_dims(config, **parallel)
    models = _meta_stages(config, dims, cfg)
    init_parallel(models, config, dims, seed=7)
    return {
        n: gather_full(p.detach(), get_shard(p), dims, config.vocab_size)
        for m in models
        for n, p in m.named_parameters()
    }


def test_random_init_is_the_same_under_every_layout():
    single = pool(2).run(_init_case, {"pipeline_model_parallel_size": 2})
    split = pool(8).run(
        _init_case,
        {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
    )
    full = {n: t for out in single for n, t in out.items()}
    for out in split:
        for name, tensor in out.items():
            assert torch.equal(tensor, full[name]), name
    assert full["decoder.layers.0.pre_mlp_layernorm.weight"].eq(1).all()
    assert 0.01 < float(full["decoder.layers.0.mlp.experts.linear_fc1.weight"].std()) < 0.03
    # model.router_init_std / output_init_std scale the routers and the output layer only
    assert 0.2 < float(full["decoder.layers.1.mlp.router.weight"].std()) < 0.4
    assert 0.07 < float(full["output_layer.weight"][: tiny_config().vocab_size].std()) < 0.13
    assert 0.01 < float(full["embedding.word_embeddings.weight"].std()) < 0.03
