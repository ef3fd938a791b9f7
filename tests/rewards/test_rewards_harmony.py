"""The rewards on what harmony's parser makes of rendered completions (the trainer's path)."""

from helpers.reward_rows import gsm8k_row

from megatron_gptoss.config import RewardConfig
from megatron_gptoss.harmony import parse_completion, render_conversation
from megatron_gptoss.rewards import RewardScorer


def parsed(*turn, cut=0):
    """The parsed completion of an assistant turn rendered after a user question, its last `cut` tokens
    dropped (a completion stopped by the token limit)."""
    rendered = render_conversation([{"role": "user", "content": "How many?"}, *turn])
    tokens = rendered.token_ids[rendered.num_prompt_tokens : len(rendered.token_ids) - cut]
    return parse_completion(tokens)


def test_gsm8k_and_format_on_parsed_completions():
    analysis = {"role": "assistant", "channel": "analysis", "content": "12 + 6 = 18"}
    completions = [
        parsed(analysis, {"role": "assistant", "channel": "final", "content": "\\boxed{18}"}),
        parsed(analysis, {"role": "assistant", "channel": "final", "content": "It is 18 apples."}, cut=1),
        parsed({"role": "assistant", "channel": "final", "content": "18"}),
        parsed(analysis, cut=1),  # no final message
    ]
    scorer = RewardScorer(RewardConfig(name="gsm8k", format_weight=0.25, workers=0))
    rewards, metrics = scorer.score_batch(completions, [gsm8k_row("18")] * 4)
    assert rewards == [1.25, 1.0, 1.0, 0.0]
    assert metrics["reward/reason/format_not_ended"] == 1.0
    assert metrics["reward/reason/format_no_analysis_first"] == 1.0
    assert metrics["reward/reason/no_final"] == 1.0
