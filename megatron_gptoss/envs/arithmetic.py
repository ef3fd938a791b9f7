"""Arithmetic on small integers: "<bos>3+5=" -> "8<eos>", verified exactly.

Problems are every (a, op, b) with a, b in 0..`EnvConfig.max_operand` and op in
`EnvConfig.operators` ("+", "-", "*"); the answer is the decimal result, which may be negative
or have several digits. With the defaults (max_operand=9, operators "+-") there are 200 problems.

Held-out evaluation: the problems are listed in a fixed order and shuffled by
`random.Random(EnvConfig.eval_seed)`; the first `eval_size` are the evaluation set and are never
sampled for training. Training prompts are drawn uniformly, with replacement, from the others.
The split depends only on (max_operand, operators, eval_size, eval_seed), not on `EnvConfig.seed`,
so runs with different seeds are evaluated on the same problems.

Reward of a response (token ids after the prompt). Its body is the tokens before the first <eos>;
tokens after that <eos> are ignored. A response without <eos> was truncated.
- 1.0 if the response terminated and the body is the answer written canonically
  (str(answer): no leading zeros, no "+", "-" only for negative answers). This is `correct`.
- Otherwise, with `EnvConfig.partial_credit` (the default), the sum of
    0.1  the response terminated with <eos>;
    0.1  it terminated and the body is a canonical integer;
    c * max(0, 1 - |value - answer| / (max_operand + 1))  for such an integer (closeness),
  with c = `EnvConfig.closeness_credit` (default 0.3). A wrong answer therefore earns less than
  0.2 + c; a truncated response earns 0. Order: truncated (0) < empty or malformed body (0.1) <
  wrong integer (0.2 .. < 0.2 + c, nearer earns more) < correct (1.0). Closeness credit has a
  failure mode under RL: a policy may settle on one middle answer that is close on average.
    p * (matched leading characters) / len(answer), p = `EnvConfig.prefix_credit` (default 0),
  also for a truncated response: credit for starting the answer right, which ties the reward to
  the operands from the first step (the CPU demo uses it instead of closeness).
- Without partial credit: 0.0.
The main metric is exact-match accuracy (`correct`); the partial credit exists so that a randomly
initialised model, which seldom writes a well-formed number, gets a learning signal at once.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_gptoss.config.train import EnvConfig
from megatron_gptoss.envs.tokenizer import CharTokenizer
from megatron_gptoss.errors import ConfigError

OPERATORS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
TERMINATION_CREDIT = 0.1
NUMBER_CREDIT = 0.1
CANONICAL_INTEGER = re.compile(r"0|-?[1-9][0-9]*")


def draw_indices(
    population: int, n: int, rng: random.Random | torch.Generator | None, own: random.Random
) -> list[int]:
    """`n` indices in [0, population) drawn uniformly with replacement: with `rng` (a `random.Random` or a
    `torch.Generator`; same state -> same indices), or from `own` (a task's own stream) when it is None."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if isinstance(rng, torch.Generator):
        return torch.randint(population, (n,), generator=rng).tolist()
    draw = rng if rng is not None else own
    return [draw.randrange(population) for _ in range(n)]


@dataclass(frozen=True)
class Prompt:
    """One problem. `token_ids` start with <bos> and end with "="; `text` is the problem ("3+5=")."""

    token_ids: tuple[int, ...]
    text: str
    answer: int

    @property
    def answer_text(self) -> str:
        """The canonical written answer, e.g. "-2"."""
        return str(self.answer)


class ArithmeticTask:
    """Prompt sampling, the held-out evaluation set and the verifier of the arithmetic task.

    Raises ConfigError if `cfg.operators` is empty, repeats an operator or holds one outside
    "+-*", if `cfg.max_operand` < 0, or unless 1 <= `cfg.eval_size` < number of problems.
    """

    def __init__(self, cfg: EnvConfig, tokenizer: CharTokenizer) -> None:
        _validate(cfg)
        self.cfg = cfg
        self.tokenizer = tokenizer
        problems = [
            (a, op, b)
            for op in cfg.operators
            for a in range(cfg.max_operand + 1)
            for b in range(cfg.max_operand + 1)
        ]
        random.Random(cfg.eval_seed).shuffle(problems)
        self._eval = [self._make_prompt(*p) for p in problems[: cfg.eval_size]]
        self._train = [self._make_prompt(*p) for p in problems[cfg.eval_size :]]
        self._rng = random.Random(cfg.seed)
        # The longest answer plus its <eos>: a rollout needs at least this many new tokens.
        self.max_response_tokens = max(len(p.answer_text) for p in self._eval + self._train) + 1

    @property
    def num_train_problems(self) -> int:
        """Number of distinct problems the training stream draws from."""
        return len(self._train)

    def sample_prompts(self, n: int, rng: random.Random | torch.Generator | None = None) -> list[Prompt]:
        """`n` training prompts drawn uniformly with replacement from the non-held-out problems.

        `rng`: a `random.Random` or `torch.Generator` to draw with (same state -> same prompts);
        None draws from the task's own stream, seeded by `EnvConfig.seed` and advanced by each call.
        """
        return [self._train[i] for i in draw_indices(len(self._train), n, rng, self._rng)]

    def eval_prompts(self) -> list[Prompt]:
        """The `EnvConfig.eval_size` held-out prompts, in a fixed order; the same on every call."""
        return list(self._eval)

    @property
    def stop_token_ids(self) -> list[int]:
        """A rollout ends at <eos>."""
        return [self.tokenizer.eos_token_id]

    def score_batch(
        self, prompts: Sequence[Prompt], responses: Sequence[Sequence[int]]
    ) -> tuple[list[dict[str, float | bool]], dict[str, float]]:
        """`score` of every (prompt, response); no batch metrics."""
        return [self.score(p, r) for p, r in zip(prompts, responses)], {}

    def state_dict(self) -> dict:
        """Nothing: the trainer draws each step's prompts with a generator seeded by the step."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def close(self) -> None:
        pass

    def reference_response(self, prompt: Prompt) -> list[int]:
        """The token ids of the correct response: the answer then <eos>."""
        return self.tokenizer.encode(prompt.answer_text) + [self.tokenizer.eos_token_id]

    def score(self, prompt: Prompt, response_ids: Sequence[int] | torch.Tensor) -> dict[str, float | bool]:
        """Verify one response (generated token ids, prompt excluded; a list or a 1-D tensor).

        Returns {"reward": float in [0, 1], "correct": bool, "terminated": bool,
        "well_formed": bool}; the reward is defined in the module docstring. Token ids outside the
        tokenizer's vocabulary make the body malformed and are not an error.
        """
        ids = response_ids.tolist() if isinstance(response_ids, torch.Tensor) else list(response_ids)
        eos = self.tokenizer.eos_token_id
        terminated = eos in ids
        body_ids = ids[: ids.index(eos)] if terminated else ids
        body = self._body_text(body_ids)
        well_formed = body is not None and CANONICAL_INTEGER.fullmatch(body) is not None
        correct = terminated and body == prompt.answer_text
        if correct:
            reward = 1.0
        elif not self.cfg.partial_credit:
            reward = 0.0
        else:
            reward = TERMINATION_CREDIT if terminated else 0.0
            if terminated and well_formed and body is not None:
                distance = abs(int(body) - prompt.answer)
                closeness = max(0.0, 1.0 - distance / (self.cfg.max_operand + 1))
                reward += NUMBER_CREDIT + self.cfg.closeness_credit * closeness
            reward += self.cfg.prefix_credit * self._prefix_fraction(body_ids, prompt.answer_text)
        return {"reward": reward, "correct": correct, "terminated": terminated, "well_formed": well_formed}

    def reward(self, prompt: Prompt, response_ids: Sequence[int] | torch.Tensor) -> float:
        """The scalar reward in [0, 1] of `score`."""
        return float(self.score(prompt, response_ids)["reward"])

    def _make_prompt(self, a: int, op: str, b: int) -> Prompt:
        text = f"{a}{op}{b}="
        ids = (self.tokenizer.bos_token_id, *self.tokenizer.encode(text))
        return Prompt(token_ids=ids, text=text, answer=OPERATORS[op](a, b))

    def _prefix_fraction(self, body_ids: list[int], answer: str) -> float:
        """Fraction of `answer`'s characters that the body reproduces from its start."""
        matched = 0
        for token, char in zip(body_ids, answer):
            if self._body_text([token]) != char:
                break
            matched += 1
        return matched / len(answer)

    def _body_text(self, ids: list[int]) -> str | None:
        """The text of non-special, in-vocabulary ids; None if any id is special or unknown."""
        tok = self.tokenizer
        if any(not 0 <= i < tok.vocab_size or i in tok.special_token_ids for i in ids):
            return None
        return tok.decode(ids)


def _validate(cfg: EnvConfig) -> None:
    ops = cfg.operators
    if not ops or len(set(ops)) != len(ops) or any(op not in OPERATORS for op in ops):
        raise ConfigError(
            f"env.operators={ops!r} must be a non-empty string of distinct operators "
            f"from {''.join(OPERATORS)!r}"
        )
    if cfg.max_operand < 0:
        raise ConfigError(f"env.max_operand must be >= 0, got {cfg.max_operand}")
    total = len(ops) * (cfg.max_operand + 1) ** 2
    if not 1 <= cfg.eval_size < total:
        raise ConfigError(
            f"env.eval_size={cfg.eval_size} must be in [1, {total - 1}]: the task has {total} problems "
            f"(max_operand={cfg.max_operand}, operators={ops!r}) and needs some left for training"
        )
