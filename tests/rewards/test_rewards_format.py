import pytest
from helpers.reward_rows import completion, gsm8k_row

from megatron_gptoss.config import RewardConfig
from megatron_gptoss.rewards import format_reward, format_violation, resolve, score_one


def message(channel, content="text", recipient=None, **extra):
    return {"channel": channel, "recipient": recipient, "content": content, **extra}


def test_well_formed():
    assert format_reward(completion("42"), {}) == {"reward": 1.0}
    assert format_violation(completion("42", end="<|return|>")) is None
    # tool calls and more thinking between the analysis and the final message
    messages = [
        message("analysis"),
        message("commentary", '{"x": 1}', recipient="functions.calc", end="call"),
        message("analysis", "the tool said 2"),
        message("final", "2", end="return"),
    ]
    assert format_violation(messages) is None
    # a parser that does not report the closing token
    assert format_violation([message("analysis"), message("final")]) is None


@pytest.mark.parametrize(
    "messages, violation",
    [
        ([], "empty"),
        ([message(None), message("final")], "no_channel"),
        ([message("analysis"), message("draft")], "no_channel"),
        ([message("final")], "no_analysis_first"),
        ([message("analysis", "  "), message("final")], "no_analysis_first"),
        ([message("commentary"), message("analysis"), message("final")], "no_analysis_first"),
        ([message("analysis")], "no_final_last"),
        ([message("analysis"), message("final"), message("analysis")], "no_final_last"),
        ([message("analysis"), message("final"), message("final")], "several_finals"),
        ([message("analysis"), message("final", "")], "bad_final"),
        ([message("analysis"), message("final", recipient="functions.x")], "bad_final"),
        ([message("analysis"), message("final", end=None)], "not_ended"),
        ([message("analysis"), message("final", end="call")], "not_ended"),
        ([message("analysis"), message("final", end="end")], "not_ended"),
        ([message("analysis", role="assistant"), message("final", role="user")], "not_assistant"),
    ],
)
def test_violations(messages, violation):
    assert format_violation(messages) == violation
    assert format_reward(messages, {}) == {"reward": 0.0, "reason": violation}


def test_format_weight_adds_to_the_task_reward():
    cfg = RewardConfig(name="gsm8k", format_weight=0.5, workers=0)
    fn = resolve(cfg)
    assert score_one(cfg, fn, completion("18"), gsm8k_row("18")) == (
        1.5,
        {"boxed": 0.0, "task": 1.0, "format": 1.0},
        None,
    )
    # a truncated final message: the answer counts, the format does not
    total, metrics, reason = score_one(cfg, fn, completion("18", end=None), gsm8k_row("18"))
    assert (total, metrics["format"], reason) == (1.0, 0.0, "format_not_ended")
    # without a weight the format is not computed
    plain = RewardConfig(name="gsm8k", workers=0)
    assert score_one(plain, fn, completion("17"), gsm8k_row("18"))[:2] == (0.0, {"boxed": 0.0, "task": 0.0})


def test_format_alone():
    cfg = RewardConfig(name="format", format_weight=3.0, workers=0)
    assert score_one(cfg, resolve(cfg), completion("x"), {}) == (1.0, {"format": 1.0}, None)
    assert score_one(cfg, resolve(cfg), completion(None), {})[0] == 0.0
