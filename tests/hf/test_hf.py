"""HF checkpoint directories: export -> transformers, transformers -> import, round trips, atomic saves,
corrupted directories, and the parameter counts.

Export is bf16, so the transformers comparison uses a model whose float32 weights are bf16-representable
(each parameter rounded through bf16 first): such a model survives a bf16 export exactly, and transformers'
logits on the exported directory must equal ours to <= 1e-6 (float32 arithmetic differences only).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.hf_reference import hf_twin, rel_err
from safetensors.torch import load_file, save_file

import megatron_gptoss
from megatron_gptoss.config import gpt_oss_tiny
from megatron_gptoss.errors import CheckpointError
from megatron_gptoss.hf import io as hf_module
from megatron_gptoss.hf import iter_hf_tensors, load_hf, save_hf
from megatron_gptoss.model import build_model

REPO = Path(__file__).resolve().parents[2]
# Fields config.json does not carry, given back on import.
OURS = {"make_vocab_size_divisible_by": 32, "attention_backend": "eager"}


def tiny_model(seed=0, bf16_values=False, **overrides):
    """A tiny model with non-trivial biases, sinks and norms; optionally bf16-representable in float32."""
    model = build_model(gpt_oss_tiny(attention_backend="eager", **overrides), seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
            if bf16_values:
                p.copy_(p.to(torch.bfloat16).float())
    return model


def tokens_for(model, seed=0, length=21):
    return torch.randint(
        0, model.config.vocab_size, (2, length), generator=torch.Generator().manual_seed(seed)
    )


def transformers_from(path):
    from transformers import GptOssForCausalLM

    return GptOssForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def assert_same_parameters(a, b):
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert pa[name].dtype == pb[name].dtype and torch.equal(pa[name], pb[name]), name


# ------------------------------------------------------------------------------------------------
# Export and import against transformers
def test_export_loads_in_transformers_with_identical_logits(tmp_path):
    model = tiny_model(bf16_values=True, vocab_size=90)  # 90 real rows, 96 padded
    path = save_hf(model, tmp_path / "export")
    reference = transformers_from(path)
    exported = dict(iter_hf_tensors(model, model.config))
    for name, param in reference.named_parameters():
        assert torch.equal(param, exported[name]), name
    tokens = tokens_for(model, length=2 * model.config.sliding_window + 5)
    with torch.no_grad():
        ours, theirs = model(tokens), reference(tokens).logits
    assert theirs.shape == ours.shape == (2, tokens.shape[1], 90)
    assert rel_err(ours, theirs) <= 1e-6


def test_float32_export_matches_unrounded_model(tmp_path):
    model = tiny_model(seed=3)
    path = save_hf(model, tmp_path / "export", dtype=torch.float32)
    assert json.loads((path / "config.json").read_text())["torch_dtype"] == "float32"
    tokens = tokens_for(model, seed=1)
    with torch.no_grad():
        assert rel_err(model(tokens), transformers_from(path)(tokens).logits) <= 1e-6


def test_transformers_save_pretrained_imports_identically(tmp_path):
    model = tiny_model(seed=1)
    hf_twin(model).save_pretrained(tmp_path / "hf")
    loaded = load_hf(tmp_path / "hf", **OURS)
    assert_same_parameters(model, loaded)
    tokens = tokens_for(model, seed=2)
    with torch.no_grad():
        assert torch.equal(loaded(tokens), model(tokens))


# ------------------------------------------------------------------------------------------------
# Round trips, shards, atomic writes
def test_round_trip_is_bitwise_with_sharding(tmp_path):
    model = tiny_model(seed=2).to(torch.bfloat16)
    bound = 12_000
    path = save_hf(model, tmp_path / "ck", max_shard_bytes=bound)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and files == sorted(p.name for p in path.glob("*.safetensors"))
    total = 0
    for file in files:
        tensors = load_file(str(path / file))
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        assert size <= bound or len(tensors) == 1, file
        assert all(t.dtype == torch.bfloat16 for t in tensors.values())
        total += size
    assert index["metadata"]["total_size"] == total == 2 * model.config.param_counts()["total"]
    assert_same_parameters(model, load_hf(path, dtype=torch.bfloat16, **OURS))


def test_public_api_and_bf16_rounding(tmp_path):
    """Top-level load_hf/save_hf; a float32 model exported in bf16 comes back as its bf16 rounding."""
    model = tiny_model(seed=4)
    megatron_gptoss.save_hf(model, tmp_path / "ck")
    loaded = dict(megatron_gptoss.load_hf(tmp_path / "ck").named_parameters())
    n = model.config.vocab_size
    for name, p in model.named_parameters():
        q = loaded[name]
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            assert q.shape[0] == 128 and not q[n:].any()  # default padding: a multiple of 128 rows
            p, q = p[:n], q[:n]
        assert q.dtype == torch.float32 and torch.equal(q, p.to(torch.bfloat16).float()), name


def test_interrupted_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    old = tiny_model(seed=5).to(torch.bfloat16)
    path = save_hf(old, tmp_path / "ck", max_shard_bytes=12_000)
    calls = {"n": 0}
    real_save = hf_module.save_file

    def failing_save(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt("interrupted")
        real_save(*args, **kwargs)

    monkeypatch.setattr(hf_module, "save_file", failing_save)
    new = tiny_model(seed=6).to(torch.bfloat16)
    with pytest.raises(KeyboardInterrupt):
        save_hf(new, path, max_shard_bytes=12_000)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no staging directory left behind
    assert_same_parameters(old, load_hf(path, dtype=torch.bfloat16, **OURS))

    monkeypatch.setattr(hf_module, "save_file", real_save)
    save_hf(new, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert len(list(path.glob("*.safetensors"))) == 1  # the old shards went with the old directory
    assert_same_parameters(new, load_hf(path, dtype=torch.bfloat16, **OURS))


def test_save_refuses_to_replace_other_directories(tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="config.json"):
        save_hf(tiny_model(), tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "keep me"


def _rss() -> dict[str, int]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def _measure(action):
    """(result, peak RSS growth, RSS growth kept) of `action()`; Linux resets the peak via clear_refs."""
    Path("/proc/self/clear_refs").write_text("5")
    before = _rss()["VmRSS"]
    result = action()
    after = _rss()
    return result, after["VmHWM"] - before, after["VmRSS"] - before


def _mmap_allocations() -> None:
    """Allocations of 64 KiB and more get their own mappings, so freed tensors leave the resident set
    at once and the peak measures live memory rather than the allocator's free lists."""
    import ctypes

    m_mmap_threshold = -3
    ctypes.CDLL("libc.so.6").mallopt(m_mmap_threshold, 1 << 16)


def streaming_measurements(workdir: str) -> dict[str, int]:
    """Run in a fresh process (so no earlier test's allocations or threads blur the readings)."""
    tmp_path = Path(workdir)
    _mmap_allocations()
    save_hf(tiny_model(), tmp_path / "warm")
    load_hf(tmp_path / "warm")  # first use initialises lazily imported modules
    config = gpt_oss_tiny(vocab_size=4000, hidden_size=256, intermediate_size=256, num_layers=8, head_dim=32)
    model = build_model(config, seed=0)
    largest = max(t.numel() * 4 for _, t in iter_hf_tensors(model, config))
    save_hf(model, tmp_path / "src", max_shard_bytes=4 << 20, dtype=torch.float32)
    del model
    loaded, load_peak, load_kept = _measure(lambda: load_hf(tmp_path / "src", **OURS))
    _, save_peak, _ = _measure(lambda: save_hf(loaded, tmp_path / "dst", max_shard_bytes=4 << 20))
    return {
        "model_bytes": 4 * config.param_counts()["total"],  # float32, no vocabulary padding (4000 = 125 x 32)
        "largest": largest,
        "load_peak": load_peak,
        "load_kept": load_kept,
        "save_peak": save_peak,
    }


def test_streaming_holds_one_copy_of_the_model(tmp_path):
    """Measured: load_hf grows the process by the model plus a few tensors in flight (a collected state
    dict would add another model); save_hf by one shard plus a few tensors."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc peak-RSS reset")
    import subprocess
    import sys

    tests_dir = str(Path(__file__).resolve().parents[1])
    code = (
        f"import json, sys; sys.path.insert(0, {tests_dir!r}); "
        "from hf.test_hf import streaming_measurements; "
        f"print(json.dumps(streaming_measurements({str(tmp_path)!r})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    m = json.loads(out.stdout.strip().splitlines()[-1])
    mib, shard = 1 << 20, 4 << 20
    model_bytes, largest = m["model_bytes"], m["largest"]
    assert shard + 3 * largest + 8 * mib < model_bytes  # a second copy of the model breaks both bounds
    assert 0.9 * model_bytes <= m["load_kept"] <= model_bytes + 4 * mib, m  # the model is seen
    assert m["load_peak"] <= model_bytes + 3 * largest + 8 * mib, m
    assert m["save_peak"] <= shard + 3 * largest + 8 * mib, m


# ------------------------------------------------------------------------------------------------
# Corrupted directories
def edit_shard(path, change):
    """Apply `change(tensors)` to the checkpoint's only shard and rewrite the index to match."""
    (file,) = path.glob("*.safetensors")
    tensors = load_file(str(file))
    change(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": dict.fromkeys(tensors, file.name)}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


CORRUPTIONS = {
    "missing_tensor": (
        lambda t: t.pop("model.layers.1.self_attn.v_proj.weight"),
        r"missing tensors \['model.layers.1.self_attn.v_proj.weight'\]",
    ),
    "missing_parameter": (lambda t: t.pop("model.norm.weight"), r"missing tensors \['model.norm.weight'\]"),
    "extra_tensor": (
        lambda t: t.update({"model.layers.0.mlp.experts.extra": torch.zeros(3)}),
        "unexpected tensor 'model.layers.0.mlp.experts.extra'",
    ),
    "extra_layer": (
        lambda t: t.update({"model.layers.2.input_layernorm.weight": torch.zeros(32)}),
        "unexpected tensor 'model.layers.2.input_layernorm.weight': layer 2",
    ),
    "wrong_shape": (
        lambda t: t.update({"model.layers.0.self_attn.o_proj.weight": torch.zeros(32, 63)}),
        r"'model.layers.0.self_attn.o_proj.weight' has shape \(32, 63\), expected \(32, 64\)",
    ),
}


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_corrupted_directory_names_the_tensor(tmp_path, kind):
    path = save_hf(tiny_model(), tmp_path / "ck")
    change, message = CORRUPTIONS[kind]
    edit_shard(path, change)
    with pytest.raises(CheckpointError, match=message):
        load_hf(path, **OURS)


@pytest.mark.parametrize("cut", ["data", "header"])
def test_truncated_file_names_the_file(tmp_path, cut):
    path = save_hf(tiny_model(), tmp_path / "ck", max_shard_bytes=50_000)
    file = sorted(path.glob("*.safetensors"))[-1]
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 100] if cut == "data" else data[:6])
    with pytest.raises(CheckpointError, match=f"cannot read safetensors file .*{file.name}"):
        load_hf(path, **OURS)


def test_directory_level_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_hf(tmp_path)
    path = save_hf(tiny_model(), tmp_path / "ck", max_shard_bytes=50_000)
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"]["model.norm.weight"] = "model-00009-of-00009.safetensors"
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model-00009-of-00009.safetensors.* does not exist"):
        load_hf(path, **OURS)
    first = sorted(path.glob("*.safetensors"))[0].name
    index["weight_map"]["model.norm.weight"] = first
    index_file.write_text(json.dumps(index))
    with pytest.raises(
        CheckpointError, match=f"'model.norm.weight' is listed in the index but absent from '{first}'"
    ):
        load_hf(path, **OURS)
    index_file.unlink()
    with pytest.raises(CheckpointError, match="neither model.safetensors.index.json nor model.safetensors"):
        load_hf(path, **OURS)


# ------------------------------------------------------------------------------------------------
def test_param_count_tool():
    out = subprocess.run(
        [sys.executable, str(REPO / "tools" / "param_count.py"), "gpt_oss_120b", "gpt_oss_20b"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert out[0].split()[:5] == ["gpt_oss_120b", "total", "116.8B", "active", "5.1B"]
    assert out[1].split()[:5] == ["gpt_oss_20b", "total", "20.9B", "active", "3.6B"]


def test_param_counts_equal_checkpoint_sizes():
    model = tiny_model()
    counts = model.config.param_counts()
    hf = dict(iter_hf_tensors(model, model.config))
    assert counts["total"] == sum(t.numel() for t in hf.values())
    assert counts["embedding"] == hf["model.embed_tokens.weight"].numel()
