"""A task read from prompt files (`data`: verl's schema or GSM8K), in the harmony format the released models
know: prompts rendered by `harmony.render_prompt`, rollouts stopped at `<|return|>` / `<|call|>`, each
completion parsed by `harmony.parse_completion` and scored by the configured reward (`rewards`: GSM8K,
IFEval, format, or a user function) in worker processes under a timeout.

The prompt stream's position is the task's state (`state_dict`), saved with every checkpoint, so a resumed
run draws the prompts an uninterrupted one would. Every rank draws the same prompts.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from megatron_gptoss.config.data import DataConfig
from megatron_gptoss.config.reward import RewardConfig
from megatron_gptoss.data import PromptDataset, PromptRow
from megatron_gptoss.errors import ConfigError
from megatron_gptoss.harmony import parse_completion, render_prompt, stop_token_ids
from megatron_gptoss.harmony.tokenizer import HarmonyTokenizer, get_tokenizer
from megatron_gptoss.rewards import RewardScorer

log = logging.getLogger(__name__)


class DatasetTask:
    """Prompts from `data.train_files`, held-out prompts from `data.eval_files` (at most `eval_size`), and
    the reward of `reward` on parsed harmony completions."""

    def __init__(
        self,
        data: DataConfig,
        reward: RewardConfig,
        eval_size: int,
        tools: Mapping[str, Any] | None = None,
    ):
        """`tools`: keywords of `harmony.render_prompt` (`tools`, `builtin_tools`) describing the tools
        of an agentic rollout to the model in every prompt."""
        if not data.train_files:
            raise ConfigError("env.name='dataset' needs data.train_files (parquet or JSONL prompt files)")
        self.tokenizer: HarmonyTokenizer = get_tokenizer()
        render = functools.partial(render_prompt, **(tools or {}))
        self.train = PromptDataset(data, render)
        self._eval: list[PromptRow] = []
        if data.eval_files:
            held_out = PromptDataset(data, render, split="eval")
            for row in (row for batch in held_out.batches(64) for row in batch):
                if len(self._eval) == eval_size:
                    break
                self._eval.append(row)
        self.reward = reward
        self._scorer: RewardScorer | None = None  # its worker processes start at the first score
        self.stop_token_ids = stop_token_ids()

    def sample_prompts(self, n: int, rng: Any = None) -> list[PromptRow]:
        """The next `n` prompts of the stream (`rng` is unused: the stream's position is the state)."""
        batch = self.train.next_batch(n)
        if len(batch) < n:
            raise ConfigError(
                f"the prompt files ran out after data.epochs={self.train.epoch} epochs: "
                "raise data.epochs (0: unlimited) or lower run.steps"
            )
        return batch

    def eval_prompts(self) -> list[PromptRow]:
        """The held-out prompts (the first `env.eval_size` rows of `data.eval_files`, in file order)."""
        return list(self._eval)

    def score_batch(
        self, prompts: Sequence[PromptRow], responses: Sequence[Sequence[int]]
    ) -> tuple[list[dict[str, float | bool]], dict[str, float]]:
        """Parse every completion and score it against its row; (per-row scores, the batch's reward
        metrics). A completion scores "correct" when its reward reaches 1."""
        parsed = [[dict(m) for m in parse_completion(list(ids))] for ids in responses]
        if self._scorer is None:
            self._scorer = RewardScorer(self.reward)
        rewards, metrics = self._scorer.score_batch(parsed, [p.reward_row() for p in prompts])
        return [{"reward": r, "correct": r >= 1.0} for r in rewards], metrics

    def reference_response(self, prompt: PromptRow) -> list[int]:
        raise ConfigError("the dataset task has no reference responses: supervised training needs sft.data")

    def state_dict(self) -> dict[str, Any]:
        return {"dataset": self.train.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.train.load_state_dict(state["dataset"])

    def close(self) -> None:
        if self._scorer is not None:
            self._scorer.close()
