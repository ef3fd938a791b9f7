"""Task rewards of parsed harmony completions: GSM8K answers, IFEval instructions, the harmony format, or
any importable `module:function`, scored in worker processes under a timeout by `RewardScorer`; a function
that keeps failing stops the run (`RewardFailureGuard`)."""

from megatron_gptoss.rewards.formatting import format_reward, format_violation
from megatron_gptoss.rewards.gsm8k import gsm8k_reward, model_answer, reference_answer
from megatron_gptoss.rewards.guard import RewardError, RewardFailureGuard
from megatron_gptoss.rewards.ifeval import VERIFIERS, follows, ifeval_reward, instructions
from megatron_gptoss.rewards.pool import RewardScorer
from megatron_gptoss.rewards.score import resolve, score_one
from megatron_gptoss.rewards.types import Message, RewardFn, RewardResult, final_text

__all__ = [
    "VERIFIERS",
    "Message",
    "RewardError",
    "RewardFailureGuard",
    "RewardFn",
    "RewardResult",
    "RewardScorer",
    "final_text",
    "follows",
    "format_reward",
    "format_violation",
    "gsm8k_reward",
    "ifeval_reward",
    "instructions",
    "model_answer",
    "reference_answer",
    "resolve",
    "score_one",
]
