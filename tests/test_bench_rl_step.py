"""benchmarks/bench_rl_step.py at toy size on the CPU: the LoRA RL step runs through the one trainer (the
gpt-oss-20b recipe from a synthetic MXFP4 checkpoint; the gpt-oss-120b recipe from weights drawn in place),
reports every phase, and its sync sends exactly the adapters (the engine shares the frozen base)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_rl_step  # noqa: E402
import pytest  # noqa: E402

from megatron_gptoss.config import load_config  # noqa: E402
from megatron_gptoss.model import GPTOSSModel  # noqa: E402
from megatron_gptoss.model.lora import is_adapter_param  # noqa: E402


@pytest.mark.parametrize(("model", "weights"), [("gpt_oss_20b", "checkpoint"), ("gpt_oss_120b", "random")])
def test_tiny_step_reports_phases_and_sends_only_the_adapters(tmp_path, model, weights):
    args = ["--tiny", "--model", model, "--weights", weights, "--steps", "1", "--out", str(tmp_path)]
    (step,) = bench_rl_step.main(args)
    for phase in bench_rl_step.COLUMNS:
        assert step[phase] > 0, phase
    assert step["response/length_mean"] > 0
    # the generation's steps: one prefill step of the 4 rows' prompts, then one decode step per further token
    assert step["engine/decode_steps"] == step["engine/steps"] - 1 >= step["response/length_mean"] - 1
    assert step["engine/prefill_tokens"] > 0 and 0 < step["engine/decode_rows_mean"] <= 4
    assert step["engine/kv_cache_gib"] > 0  # the cache the engine made, freed by its sleep (a table column)
    config = load_config(bench_rl_step.CONFIGS[model], bench_rl_step.TINY).model
    net = GPTOSSModel(config, device="meta")
    adapter_bytes = sum(4 * p.numel() for name, p in net.named_parameters() if is_adapter_param(name))
    assert 0 < step["sync/bytes"] == adapter_bytes
