"""Digit strings: "<bos>3172=" -> "2713<eos>" (`reverse`) or "1237<eos>" (`sort`), verified exactly.

Problems are every string of `EnvConfig.digits` decimal digits (10**digits of them; leading zeros allowed);
the answer is the string reversed (env.name "reverse") or its digits in ascending order ("sort"), as many
digits as the question. The skill is an algorithm over positions, not a table: a model that learned it on
the training strings answers the held-out ones.

Held-out evaluation: the strings are listed in order and shuffled by `random.Random(EnvConfig.eval_seed)`;
the first `eval_size` are the evaluation set and are never sampled for training. Training prompts are drawn
uniformly, with replacement, from the others. The split depends only on (digits, eval_size, eval_seed).

Reward of a response (token ids after the prompt; its body is the tokens before the first <eos>, a response
without <eos> was truncated):
- 1.0 if the response terminated and the body is the answer. This is `correct`.
- Otherwise `EnvConfig.digit_credit` x (positions i where body[i] == answer[i]) / digits, counting the first
  `digits` tokens of the body (a truncated response included): a denser signal than exact match, so a group
  of samples differs in reward before any of them is right. 0 with `digit_credit` 0.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from megatron_gptoss.config.env import EnvConfig
from megatron_gptoss.envs.arithmetic import draw_indices
from megatron_gptoss.envs.tokenizer import CharTokenizer
from megatron_gptoss.errors import ConfigError

TRANSFORMS: dict[str, Callable[[str], str]] = {
    "reverse": lambda s: s[::-1],
    "sort": lambda s: "".join(sorted(s)),
}


@dataclass(frozen=True)
class DigitPrompt:
    """One problem. `token_ids` start with <bos> and end with "="; `text` is the question ("3172=");
    `answer` the answer's digits ("2713"; leading zeros kept)."""

    token_ids: tuple[int, ...]
    text: str
    answer: str


class DigitTask:
    """Prompt sampling, the held-out evaluation set and the verifier of a digit-string task (`reverse`,
    `sort`).

    Raises ConfigError if `cfg.name` names no transform, unless 1 <= `cfg.digits` <= 6, or unless
    1 <= `cfg.eval_size` < 10**digits.
    """

    def __init__(self, cfg: EnvConfig, tokenizer: CharTokenizer) -> None:
        if cfg.name not in TRANSFORMS:
            raise ConfigError(f"env.name={cfg.name!r} is not a digit task: one of {sorted(TRANSFORMS)}")
        if not 1 <= cfg.digits <= 6:
            raise ConfigError(f"env.digits must be in [1, 6] (every question is listed), got {cfg.digits}")
        total = 10**cfg.digits
        if not 1 <= cfg.eval_size < total:
            raise ConfigError(
                f"env.eval_size={cfg.eval_size} must be in [1, {total - 1}]: the task has {total} strings of "
                f"{cfg.digits} digits and needs some left for training"
            )
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.transform = TRANSFORMS[cfg.name]
        strings = [str(i).zfill(cfg.digits) for i in range(total)]
        random.Random(cfg.eval_seed).shuffle(strings)
        self._eval = [self._make_prompt(s) for s in strings[: cfg.eval_size]]
        self._train = [self._make_prompt(s) for s in strings[cfg.eval_size :]]
        self._rng = random.Random(cfg.seed)
        self.max_response_tokens = cfg.digits + 1  # the answer, then <eos>

    @property
    def num_train_problems(self) -> int:
        """Number of distinct strings the training stream draws from."""
        return len(self._train)

    def sample_prompts(self, n: int, rng: random.Random | torch.Generator | None = None) -> list[DigitPrompt]:
        """`n` training prompts drawn uniformly with replacement from the non-held-out strings; `rng` as in
        `ArithmeticTask.sample_prompts` (None: the task's own stream, seeded by `EnvConfig.seed`)."""
        return [self._train[i] for i in draw_indices(len(self._train), n, rng, self._rng)]

    def eval_prompts(self) -> list[DigitPrompt]:
        """The `EnvConfig.eval_size` held-out prompts, in a fixed order; the same on every call."""
        return list(self._eval)

    @property
    def stop_token_ids(self) -> list[int]:
        """A rollout ends at <eos>."""
        return [self.tokenizer.eos_token_id]

    def reference_response(self, prompt: DigitPrompt) -> list[int]:
        """The token ids of the correct response: the answer's digits then <eos>."""
        return self.tokenizer.encode(prompt.answer) + [self.tokenizer.eos_token_id]

    def score_batch(
        self, prompts: Sequence[DigitPrompt], responses: Sequence[Sequence[int]]
    ) -> tuple[list[dict[str, float | bool]], dict[str, float]]:
        """`score` of every (prompt, response); no batch metrics."""
        return [self.score(p, r) for p, r in zip(prompts, responses)], {}

    def score(
        self, prompt: DigitPrompt, response_ids: Sequence[int] | torch.Tensor
    ) -> dict[str, float | bool]:
        """Verify one response (generated token ids, prompt excluded; a list or a 1-D tensor).

        Returns {"reward": float in [0, 1], "correct": bool, "terminated": bool, "digits_right": float (the
        share of the answer's positions written right)}; the reward is defined in the module docstring. Ids
        that are no digit (specials, ids beyond the tokenizer) never match; they are not an error.
        """
        ids = response_ids.tolist() if isinstance(response_ids, torch.Tensor) else list(response_ids)
        eos = self.tokenizer.eos_token_id
        terminated = eos in ids
        body = ids[: ids.index(eos)] if terminated else ids
        answer = self.tokenizer.encode(prompt.answer)
        right = sum(int(a == b) for a, b in zip(body, answer)) / len(answer)
        correct = terminated and body == answer
        reward = 1.0 if correct else self.cfg.digit_credit * right
        return {"reward": reward, "correct": correct, "terminated": terminated, "digits_right": right}

    def reward(self, prompt: DigitPrompt, response_ids: Sequence[int] | torch.Tensor) -> float:
        """The scalar reward in [0, 1] of `score`."""
        return float(self.score(prompt, response_ids)["reward"])

    def state_dict(self) -> dict:
        """Nothing: the trainer draws each step's prompts with a generator seeded by the step."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def close(self) -> None:
        pass

    def _make_prompt(self, question: str) -> DigitPrompt:
        text = f"{question}="
        ids = (self.tokenizer.bos_token_id, *self.tokenizer.encode(text))
        return DigitPrompt(token_ids=ids, text=text, answer=self.transform(question))
