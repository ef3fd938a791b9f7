"""`model.lora`: defaults, validation naming the field, nested YAML sections and command-line overrides."""

import dataclasses

import pytest

from megatron_gptoss.config import ConfigError, ModelConfig, gpt_oss_tiny, load_config
from megatron_gptoss.config.lora import LoRAConfig


def test_rank_zero_is_off_and_rank_turns_it_on_with_default_targets():
    assert not gpt_oss_tiny().lora.enabled
    lora = gpt_oss_tiny(lora=LoRAConfig(rank=8)).lora
    assert lora.enabled and lora.dropout == 0.0
    assert lora.targets == ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    assert lora.scale == pytest.approx(lora.alpha / 8)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"rank": -1}, "model.lora.rank"),
        ({"rank": 4, "alpha": 0.0}, "model.lora.alpha"),
        ({"rank": 4, "dropout": 1.0}, "model.lora.dropout"),
        ({"rank": 4, "targets": ["linear_qkv", "lm_head"]}, r"model.lora.targets.*'lm_head'"),
        ({"rank": 4, "targets": ["router", "router"]}, "model.lora.targets lists a layer twice"),
        ({"rank": 4, "targets": []}, "model.lora.targets is empty"),
    ],
)
def test_validation_names_the_field(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        gpt_oss_tiny(lora=LoRAConfig(**kwargs))


def test_command_line_overrides_reach_the_nested_section(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  preset: gpt_oss_tiny\n  lora:\n    alpha: 4\n")
    overrides = ["model.lora.rank=8", "model.lora.targets=linear_qkv,router", "model.lora.dropout=0.1"]
    cfg = load_config(path, overrides)
    assert cfg.model.lora == LoRAConfig(rank=8, alpha=4.0, dropout=0.1, targets=["linear_qkv", "router"])
    assert isinstance(cfg.model.lora.alpha, float) and cfg.model.num_layers == 2
    # without a file, and with the file's section left as it was
    assert load_config(None, ["model.preset=gpt_oss_tiny", "model.lora.rank=2"]).model.lora.rank == 2
    assert load_config(path).model.lora == LoRAConfig(alpha=4.0)


@pytest.mark.parametrize(
    "override,match",
    [
        ("model.lora.rank=two", r"model.lora.rank='two': expected an integer"),
        ("model.lora.ranks=2", r"unknown fields in section 'model.lora': \['ranks'\]"),
        ("model.lora.rank=-3", "model.lora.rank must be >= 0"),
        ("model.lora.targets=linear_qkv,experts", "model.lora.targets has unknown layers"),
        ("model.lora=8", "model.lora must be a mapping of fields"),
    ],
)
def test_bad_overrides_name_the_field(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, ["model.preset=gpt_oss_tiny", override])


def test_a_section_that_is_not_a_mapping_is_named(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  lora: 8\n")
    with pytest.raises(ConfigError, match="section 'model.lora' of the file is not a mapping"):
        load_config(path, ["model.lora.rank=2"])


def test_manifest_round_trip_rebuilds_the_nested_dataclass():
    cfg = gpt_oss_tiny(lora=LoRAConfig(rank=4, targets=["linear_fc1"]))
    assert ModelConfig(**dataclasses.asdict(cfg)) == cfg
