"""Careless inputs fail while the config loads (or, for memory, before anything is allocated), with one
ConfigError naming the field and the numbers: an empty config file, an empty output directory, a GRPO group
of one, a collective timeout shorter than the watchdog's bound, sizes that cannot fit."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_gptoss.config import ConfigError, EmbeddedEngineConfig, gpt_oss_tiny, load_config
from megatron_gptoss.config.memory import check_fits, kv_cache_bytes, run_memory
from megatron_gptoss.engine_api.protocol import SamplingParams
from megatron_gptoss.rollout.embedded import EmbeddedEngine

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs/demo_cpu.yaml"


def test_an_empty_config_file_is_an_error(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing but a comment\n")
    with pytest.raises(ConfigError, match=f"{empty} is empty"):
        load_config(empty)


def test_an_empty_output_dir_is_an_error():
    with pytest.raises(ConfigError, match="run.output_dir is empty"):
        load_config(DEMO, ["run.output_dir=''"])
    assert load_config(DEMO, ["run.output_dir=."]).run.output_dir == "."


def test_a_group_of_one_fails_at_load_under_a_group_estimator():
    with pytest.raises(ConfigError, match="rollout.n_samples_per_prompt=1 with algorithm.advantage='grpo'"):
        load_config(DEMO, ["rollout.n_samples_per_prompt=1"])
    with pytest.raises(ConfigError, match="'rloo'"):
        load_config(DEMO, ["rollout.n_samples_per_prompt=1", "algorithm.advantage=rloo"])
    ok = load_config(DEMO, ["rollout.n_samples_per_prompt=1", "algorithm.advantage=reinforce_pp"])
    assert ok.rollout.n_samples_per_prompt == 1


def test_the_collective_timeout_must_outlast_the_watchdog():
    with pytest.raises(ConfigError) as err:
        load_config(DEMO, ["run.collective_timeout_s=30"])
    assert "run.collective_timeout_s=30.0 must exceed run.watchdog_stall_s=120.0" in str(err.value)
    with pytest.raises(ConfigError, match="run.watchdog_step_stall_s=300.0"):
        load_config(DEMO, ["run.watchdog_step_stall_s=300"])
    assert load_config(DEMO, ["run.collective_timeout_s=30", "run.watchdog_stall_s=0"])  # no watchdog


def test_an_arithmetic_task_too_large_to_list_is_refused():
    with pytest.raises(ConfigError) as err:
        load_config(DEMO, ["env.max_operand=1000000000000"])
    assert "env.max_operand=1000000000000 with 2 operator(s) makes 2e+24" in str(err.value)
    assert "GiB" in str(err.value) and "env.max_operand <= 706" in str(err.value)
    assert load_config(DEMO, ["env.max_operand=706"]).env.max_operand == 706
    with pytest.raises(ConfigError):
        load_config(DEMO, ["env.max_operand=707"])


def test_responses_longer_than_the_context_are_refused():
    context = "exceeds the model's context, model.max_position_embeddings=1024"
    with pytest.raises(ConfigError, match=f"rollout.max_new_tokens=100000000 {context}"):
        load_config(DEMO, ["rollout.max_new_tokens=100000000"])


def test_a_run_too_large_for_the_memory_is_refused_with_the_estimate():
    cfg = load_config(DEMO, ["rollout.max_new_tokens=1000", "embedded.max_batch_slots=4096",
                             "embedded.max_step_tokens=4096", "rollout.prompts_per_step=512"])  # fmt: skip
    parts = run_memory(cfg, world=1)
    assert parts["kv_rows"] == 4096 and parts["kv_tokens"] == 1001
    with pytest.raises(ConfigError) as err:
        check_fits(cfg, 1, 2**30, "the host memory")
    message = str(err.value)
    assert f"at least {parts['total'] / 2**30:.3g} GiB per rank" in message
    assert "engine KV cache" in message and "4096 rows of up to 1001 tokens" in message
    assert "the host memory (1 GiB)" in message and parts["kv_cache"] > 2**30
    check_fits(cfg, 1, parts["total"], "the host memory")  # exactly enough passes
    defaults = load_config(None, [])  # gpt-oss-20b with every default, on one rank
    assert run_memory(defaults, world=1)["learner"] > 300 * 2**30
    with pytest.raises(ConfigError, match="learner 3[0-9][0-9] GiB"):
        check_fits(defaults, 1, 64 * 2**30, "the host memory")


def test_the_kv_cache_estimate_is_the_cache_the_engine_makes():
    model = gpt_oss_tiny(vocab_size=32)  # full and sliding-window layers
    prompts, new = [[1, 2, 3, 4, 5]] * 3, 40
    sizes = dict(dtype_bytes=4, block_size=4, max_batch_slots=4)
    for step in (4, 64):  # prompts chunked by the step, then prefilled whole
        options = EmbeddedEngineConfig(block_size=4, max_batch_slots=4, max_step_tokens=step)
        engine = EmbeddedEngine(model, options=options)
        engine.generate(prompts, SamplingParams(max_new_tokens=new, seed=0))
        made = engine.sleep(1)["kv_cache_bytes"]
        assert made == kv_cache_bytes(model, 3, 5 + new, max_step_tokens=step, prompt_tokens=5, **sizes)
    # the windows hold a row's first chunk: longer prompts, more blocks; a fixed cache, a whole step's
    assert made > kv_cache_bytes(model, 3, 5 + new, max_step_tokens=64, prompt_tokens=1, **sizes)
    fixed = kv_cache_bytes(model, 3, 5 + new, max_step_tokens=64, kv_blocks=100, **sizes)
    assert fixed == kv_cache_bytes(
        model, 3, 5 + new, max_step_tokens=64, kv_blocks=100, prompt_tokens=50, **sizes
    )
