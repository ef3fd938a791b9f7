"""The generated word problems: deterministic by seed, answers right (recomputed here from the operands, and
every "x op y = z" of the worked solutions checked), operands in 1..99 and in the question, the held-out
split disjoint from training at any seeds, rows read by the GSM8K schema and scored correct by the GSM8K
reward; the cold start's conversations train the analysis and the answer, and their completions score
correct; the CLI writes every file."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_gptoss.data.conversations import conversation_examples
from megatron_gptoss.data.rows import parse_gsm8k
from megatron_gptoss.envs import word_problems
from megatron_gptoss.envs.word_problems import TEMPLATES, problems, write_splits
from megatron_gptoss.harmony import parse_completion, render_prompt
from megatron_gptoss.harmony.tokenizer import get_tokenizer
from megatron_gptoss.rewards import gsm8k_reward

ROOT = Path(__file__).resolve().parents[2]
# The answers, written independently of the templates' solvers.
ANSWERS = {
    "purchases": lambda a, b, c: c - a * b,
    "sharing": lambda a, b, c: (a + b) / c,
    "rates": lambda a, b, c: a * (b + c),
    "ages": lambda a, b, c: a * b + c,
    "spending": lambda a, b, c: a - b - c,
    "packing": lambda a, b, c: a / b - c,
}
STEP = re.compile(r"(\d+) ([-+*/]) (\d+) = \$?(\d+)")
ANSWERS_OF_STEP = {"+": int.__add__, "-": int.__sub__, "*": int.__mul__, "/": int.__floordiv__}


def test_every_template_has_an_independent_answer():
    assert set(ANSWERS) == {t.name for t in TEMPLATES}


def test_deterministic_by_seed():
    assert problems(50, 7, held_out=False) == problems(50, 7, held_out=False)
    assert problems(50, 7, held_out=True) == problems(50, 7, held_out=True)
    assert problems(50, 7, held_out=False) != problems(50, 8, held_out=False)


@pytest.mark.parametrize("held_out", [False, True])
def test_answers_are_right_and_the_worked_solution_adds_up(held_out):
    batch = problems(300, 1, held_out)
    assert {p.template for p in batch} == set(ANSWERS)
    for problem in batch:
        a, b, c = problem.operands
        assert all(1 <= x <= 99 for x in problem.operands), problem
        expected = ANSWERS[problem.template](a, b, c)
        assert expected == int(expected) >= 0 and problem.answer == expected, problem
        row = problem.row()
        numbers = [int(n) for n in re.findall(r"\d+", row["question"])]
        assert sorted(numbers) == sorted(problem.operands), row["question"]
        steps = STEP.findall(row["answer"])
        assert len(steps) == 2, row["answer"]
        for x, op, y, z in steps:
            x, y, z = int(x), int(y), int(z)
            assert {"+": x + y, "-": x - y, "*": x * y, "/": x / y}[op] == z, row["answer"]
        assert int(steps[-1][3]) == problem.answer
        assert row["answer"].endswith(f"\n#### {problem.answer}")


def test_no_question_is_in_both_splits_at_any_seeds():
    held_out = [p for seed in (0, 1) for p in problems(200, seed, held_out=True)]
    train = [p for seed in (0, 1) for p in problems(2000, seed, held_out=False)]
    assert all(p.held_out for p in held_out) and not any(p.held_out for p in train)
    assert not {p.key for p in held_out} & {p.key for p in train}
    assert not {p.row()["question"] for p in held_out} & {p.row()["question"] for p in train}
    assert len({p.key for p in problems(200, 0, held_out=True)}) == 200  # distinct within a split
    drawn = [word_problems.draw(random.Random(seed)) for seed in range(800)]
    assert 50 <= sum(p.held_out for p in drawn) <= 160  # about 1/8 of the problem space is held out


def test_an_impossible_request_fails():
    with pytest.raises(ValueError, match="distinct"):
        problems(10**6, 0, held_out=True)


def test_the_gsm8k_schema_and_reward_accept_the_reference():
    for problem in problems(100, 2, held_out=True):
        row = problem.row()
        parsed = parse_gsm8k(row, "generated")
        assert parsed.ground_truth == str(problem.answer)
        truth = {"ground_truth": row["answer"].split("####")[-1].strip()}
        right = gsm8k_reward([{"channel": "final", "content": row["answer"]}], truth)
        wrong = gsm8k_reward([{"channel": "final", "content": f"{problem.answer + 1}"}], truth)
        assert right["reward"] == 1.0 and wrong["reward"] == 0.0


def test_cold_start_conversations_train_the_steps_and_score_correct():
    """Each conversation is one trained turn: the tokens the model samples (analysis with both steps, final
    answer, through <|return|>) are trained, the prompt is not; the trained tokens, parsed as a completion,
    score 1 with the GSM8K reward against the problem's row and 0 against another answer."""
    tokenizer = get_tokenizer()
    for problem in problems(20, 3, held_out=False):
        (example,) = conversation_examples(problem.conversation(), "low", 0)
        assert example.prompt == render_prompt(
            [{"role": "user", "content": problem.question()}], reasoning_effort="low"
        )
        assert all(example.response_mask) and not any(example.trained[: example.num_prompt_tokens])
        messages = parse_completion(example.response)
        assert [m["channel"] for m in messages] == ["analysis", "final"]
        steps = STEP.findall(messages[0]["content"])
        assert len(steps) == 2 and int(steps[-1][3]) == problem.answer
        for x, op, y, z in steps:
            assert ANSWERS_OF_STEP[op](int(x), int(y)) == int(z)
        assert tokenizer.decode(example.response).endswith(f"<|message|>{problem.answer}<|return|>")
        truth = parse_gsm8k(problem.row(), "generated").ground_truth
        assert gsm8k_reward(messages, {"ground_truth": truth})["reward"] == 1.0
        assert gsm8k_reward(messages, {"ground_truth": str(problem.answer + 1)})["reward"] == 0.0


def test_the_cli_writes_both_splits(tmp_path):
    cmd = [sys.executable, str(ROOT / "tools/make_word_problems.py"), "--train", "30", "--test", "20",
           "--sft", "12", "--seed", "4", "--out", str(tmp_path)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, env=env)
    train, test = ([json.loads(line) for line in (tmp_path / name).read_text().splitlines()]
                   for name in ("train.jsonl", "test.jsonl"))  # fmt: skip
    assert len(train) == 30 and len(test) == 20
    assert test == [p.row() for p in problems(20, 4, held_out=True)]
    assert [p.name for p in write_splits(tmp_path / "again", 30, 20, 4)] == ["train.jsonl", "test.jsonl"]
    assert (tmp_path / "again/train.jsonl").read_text() == (tmp_path / "train.jsonl").read_text()
    sft = [json.loads(line) for line in (tmp_path / "sft.jsonl").read_text().splitlines()]
    assert sft == [p.conversation() for p in problems(30, 4, held_out=False)[:12]]
    assert [s["messages"][0]["content"] for s in sft] == [t["question"] for t in train[:12]]
