"""Configuration of the verifiable task (`envs`): which task, the arithmetic and digit tasks' sizes and
rewards."""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_gptoss.config.checks import check_at_least
from megatron_gptoss.errors import ConfigError


@dataclass
class EnvConfig:
    """The verifiable task."""

    # Task name (see megatron_gptoss.envs.TASKS).
    name: str = "arithmetic"
    # Largest operand of the arithmetic task.
    max_operand: int = 9
    # Operators used by the arithmetic task.
    operators: str = "+-"
    # Held-out prompts for evaluation.
    eval_size: int = 64
    # Seed of the prompt stream.
    seed: int = 1234
    # Seed choosing the held-out evaluation problems (apart from `seed`: runs share one eval set).
    eval_seed: int = 0
    # Reward partial credit (eos, well-formed number, closeness) below the 1.0 of an exact answer.
    partial_credit: bool = True
    # Weight of the closeness part of the partial credit (0 rewards only format and exact answers).
    closeness_credit: float = 0.3
    # Partial credit for the answer's leading characters written correctly (even without <eos>):
    # prefix_credit x matched prefix length / answer length. Conditions the policy on the operands early.
    prefix_credit: float = 0.0
    # Digits in a question of the digit-string tasks ("reverse", "sort"; 10**digits questions, at most 6).
    digits: int = 4
    # Digit tasks: a wrong response earns digit_credit x the share of the answer's positions it writes right.
    digit_credit: float = 0.5

    def validate(self) -> None:
        check_at_least("env", self, 1, "max_operand", "eval_size")
        check_at_least("env", self, 0, "closeness_credit", "prefix_credit", "digit_credit")
        if not self.operators:
            raise ConfigError("env.operators is empty: name at least one operator")
        if self.name == "arithmetic":
            check_arithmetic_size(self.max_operand, self.operators)


# The arithmetic task lists every problem (a, op, b) in memory, about this many bytes each (measured).
ARITHMETIC_BYTES_PER_PROBLEM = 400
MAX_ARITHMETIC_PROBLEMS = 1_000_000


def check_arithmetic_size(max_operand: int, operators: str) -> None:
    """ConfigError when the arithmetic task would list more than MAX_ARITHMETIC_PROBLEMS problems (it holds
    every one), naming the count and its estimated memory."""
    ops = len(set(operators))
    problems = ops * (max_operand + 1) ** 2
    if problems > MAX_ARITHMETIC_PROBLEMS:
        largest = math.isqrt(MAX_ARITHMETIC_PROBLEMS // ops) - 1
        gib = problems * ARITHMETIC_BYTES_PER_PROBLEM / 2**30
        raise ConfigError(
            f"env.max_operand={max_operand} with {ops} operator(s) makes {problems:.3g} arithmetic problems, "
            f"which the task holds in memory (about {gib:.3g} GiB); at most {MAX_ARITHMETIC_PROBLEMS} are "
            f"allowed: env.max_operand <= {largest} with {ops} operator(s)"
        )
