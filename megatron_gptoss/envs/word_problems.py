"""Two-step grade-school word problems in GSM8K's format, generated from templates: prompt files for the
dataset task (`env.name=dataset`, `reward.name=gsm8k`) that need no download.

    template   a story with three operands in 1..99, each in the template's own range, and a condition
               that keeps every intermediate value and the answer a non-negative integer (purchases,
               sharing, rates, ages, spending, packing)
    problem    (template, operands) -> question, a worked solution of two lines "x op y = z", the answer
    row        {"question": str, "answer": "<solution>\\n#### N"}, GSM8K's schema (`megatron_gptoss.data`)

Held-out problems are a fixed part of the problem space: those whose key (template, operands) hashes into
one of `HELD_OUT_BUCKETS` buckets of every `BUCKETS`. Training problems are drawn from the rest, so no
question is in both splits whatever the seeds (a question names its template and operands). Within a split
every problem is drawn once. The rows are a pure function of (count, seed, split).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# The held-out part of the problem space: keys hashing into HELD_OUT_BUCKETS of BUCKETS buckets (1/8).
BUCKETS = 8
HELD_OUT_BUCKETS = 1
# Held-out problems written by default (`tools/make_word_problems.py --test`).
DEFAULT_HELD_OUT = 200
# Draws per requested problem before `problems` gives up (the split's problem space is too small).
MAX_DRAWS_PER_PROBLEM = 200
NAMES = (("Ava", "she"), ("Ben", "he"), ("Chloe", "she"), ("Diego", "he"), ("Emma", "she"), ("Farid", "he"))


@dataclass(frozen=True)
class Template:
    """A story with operands (a, b, c), each drawn from its range in `ranges`; `valid` says which operand
    triples make sense (every step a non-negative integer); `solve` gives the two steps (x, op, y, z)."""

    name: str
    ranges: tuple[tuple[int, int], tuple[int, int], tuple[int, int]]
    question: str  # format string over name, pronoun (capitalised: Pronoun), a, b, c
    lines: tuple[str, str]  # the worked solution's lines, format strings over name, x1, y1, z1, x2, y2, z2
    solve: Callable[[int, int, int], tuple[tuple[int, str, int, int], tuple[int, str, int, int]]]
    valid: Callable[[int, int, int], bool]


def _step(x: int, op: str, y: int) -> tuple[int, str, int, int]:
    z = {"+": x + y, "-": x - y, "*": x * y, "/": x // y}[op]
    return x, op, y, z


TEMPLATES = (
    Template(
        "purchases",
        ((2, 9), (1, 20), (1, 99)),
        "{name} buys {a} notebooks that cost ${b} each and pays with ${c}. How many dollars of change "
        "does {name} get?",
        ("The notebooks cost {x1} * {y1} = ${z1}.", "The change is {x2} - {y2} = ${z2}."),
        lambda a, b, c: (_step(a, "*", b), _step(c, "-", a * b)),
        lambda a, b, c: a * b <= c,
    ),
    Template(
        "sharing",
        ((2, 99), (1, 99), (2, 9)),
        "{name} has {a} stickers and is given {b} more. {Pronoun} shares all of them equally among {c} "
        "friends. How many stickers does each friend get?",
        ("{name} has {x1} + {y1} = {z1} stickers.", "Each friend gets {x2} / {y2} = {z2} stickers."),
        lambda a, b, c: (_step(a, "+", b), _step(a + b, "/", c)),
        lambda a, b, c: (a + b) % c == 0,
    ),
    Template(
        "rates",
        ((2, 99), (2, 12), (2, 12)),
        "A machine makes {a} toys per hour. It runs for {b} hours on Monday and {c} hours on Tuesday. How "
        "many toys does it make on the two days?",
        ("The machine runs {x1} + {y1} = {z1} hours.", "It makes {x2} * {y2} = {z2} toys."),
        lambda a, b, c: (_step(b, "+", c), _step(a, "*", b + c)),
        lambda a, b, c: True,
    ),
    Template(
        "ages",
        ((4, 20), (3, 5), (2, 99)),
        "{name} is {a} years old. {name}'s grandmother is {b} times as old as {name}. How old will the "
        "grandmother be in {c} years?",
        ("The grandmother is {x1} * {y1} = {z1} years old.", "In {y2} years she will be {x2} + {y2} = {z2}."),
        lambda a, b, c: (_step(a, "*", b), _step(a * b, "+", c)),
        lambda a, b, c: True,
    ),
    Template(
        "spending",
        ((1, 99), (1, 99), (1, 99)),
        "{name} has ${a}. {Pronoun} spends ${b} on a book and ${c} on lunch. How many dollars does {name} "
        "have left?",
        ("{name} spends {x1} + {y1} = ${z1}.", "{name} has {x2} - {y2} = ${z2} left."),
        lambda a, b, c: (_step(b, "+", c), _step(a, "-", b + c)),
        lambda a, b, c: b + c <= a,
    ),
    Template(
        "packing",
        ((1, 99), (2, 9), (1, 99)),
        "A baker makes {a} muffins and packs them in boxes of {b}. {name} buys {c} of the boxes. How many "
        "boxes are left?",
        ("The baker fills {x1} / {y1} = {z1} boxes.", "There are {x2} - {y2} = {z2} boxes left."),
        lambda a, b, c: (_step(a, "/", b), _step(a // b, "-", c)),
        lambda a, b, c: a % b == 0 and c <= a // b,
    ),
)
BY_NAME = {t.name: t for t in TEMPLATES}


@dataclass(frozen=True)
class Problem:
    """One problem: its template, operands, the person it is about, and the answer."""

    template: str
    operands: tuple[int, int, int]
    person: int  # index into NAMES

    @property
    def key(self) -> str:
        """What decides the split: the template and the operands (not the person)."""
        return f"{self.template}:{':'.join(map(str, self.operands))}"

    @property
    def held_out(self) -> bool:
        digest = hashlib.sha256(self.key.encode()).digest()
        return int.from_bytes(digest[:8], "big") % BUCKETS < HELD_OUT_BUCKETS

    @property
    def answer(self) -> int:
        return BY_NAME[self.template].solve(*self.operands)[1][3]

    def question(self) -> str:
        template, (name, pronoun) = BY_NAME[self.template], NAMES[self.person]
        a, b, c = self.operands
        return template.question.format(name=name, Pronoun=pronoun.capitalize(), a=a, b=b, c=c)

    def solution(self) -> str:
        """The worked solution: two lines "... x op y = z ..." ending with the answer."""
        template, (name, _) = BY_NAME[self.template], NAMES[self.person]
        (x1, _, y1, z1), (x2, _, y2, z2) = template.solve(*self.operands)
        values = {"name": name, "x1": x1, "y1": y1, "z1": z1, "x2": x2, "y2": y2, "z2": z2}
        return "\n".join(line.format(**values) for line in template.lines)

    def steps(self) -> str:
        """The two steps as arithmetic, "x1 op y1 = z1. x2 op y2 = z2." (the cold start's analysis)."""
        (x1, o1, y1, z1), (x2, o2, y2, z2) = BY_NAME[self.template].solve(*self.operands)
        return f"{x1} {o1} {y1} = {z1}. {x2} {o2} {y2} = {z2}."

    def conversation(self) -> dict[str, list[dict[str, str]]]:
        """A harmony conversation for supervised training (`megatron_gptoss.data.conversations`): the
        question, the assistant's analysis (the two steps) and its final message (the answer)."""
        return {
            "messages": [
                {"role": "user", "content": self.question()},
                {"role": "assistant", "channel": "analysis", "content": self.steps()},
                {"role": "assistant", "channel": "final", "content": str(self.answer)},
            ]
        }

    def row(self) -> dict[str, str]:
        """GSM8K's schema: {"question", "answer": "<solution>\\n#### N"}."""
        return {"question": self.question(), "answer": f"{self.solution()}\n#### {self.answer}"}


def draw(rng: random.Random) -> Problem:
    """One problem of a template chosen uniformly, operands uniform in its ranges among the valid ones."""
    template = rng.choice(TEMPLATES)
    while True:
        a, b, c = (rng.randint(low, high) for low, high in template.ranges)
        if template.valid(a, b, c):
            return Problem(template.name, (a, b, c), rng.randrange(len(NAMES)))


@functools.cache
def split_size(held_out: bool) -> int:
    """Distinct problems (keys) of one split: 25,796 held out, 180,757 for training."""
    return sum(
        Problem(t.name, (a, b, c), 0).held_out == held_out
        for t in TEMPLATES
        for a, b, c in itertools.product(*(range(low, high + 1) for low, high in t.ranges))
        if t.valid(a, b, c)
    )


def problems(count: int, seed: int, held_out: bool) -> list[Problem]:
    """`count` distinct problems (by key) of one split: the held-out part of the problem space or the rest.
    A pure function of (count, seed, held_out). ValueError when the split has fewer problems, or when
    `count` x MAX_DRAWS_PER_PROBLEM draws do not find them (a request close to the split's size)."""
    split = "held-out" if held_out else "training"
    if count > split_size(held_out):
        raise ValueError(f"{count} {split} problems asked for, the split has {split_size(held_out)} distinct")
    rng = random.Random(f"word-problems:{seed}:{'held-out' if held_out else 'train'}")
    out: list[Problem] = []
    seen: set[str] = set()
    for _ in range(count * MAX_DRAWS_PER_PROBLEM):
        if len(out) == count:
            break
        problem = draw(rng)
        if problem.held_out == held_out and problem.key not in seen:
            seen.add(problem.key)
            out.append(problem)
    if len(out) < count:
        raise ValueError(f"found {len(out)} distinct {split} problems of the {count} asked for")
    return out


def write_splits(
    out_dir: str | Path, train: int, test: int = DEFAULT_HELD_OUT, seed: int = 0, sft: int = 0
) -> list[Path]:
    """`out_dir`/train.jsonl (`train` training problems) and `out_dir`/test.jsonl (`test` held-out ones),
    one GSM8K row a line, and with `sft` > 0 `out_dir`/sft.jsonl: the first `sft` training problems as
    harmony conversations (`Problem.conversation`); returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, count, held_out in (("train", train, False), ("test", test, True)):
        path = out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(p.row()) + "\n" for p in problems(count, seed, held_out)))
        paths.append(path)
    if sft:
        path = out / "sft.jsonl"
        drawn = problems(max(sft, train), seed, held_out=False)[:sft]
        path.write_text("".join(json.dumps(p.conversation()) + "\n" for p in drawn))
        paths.append(path)
    return paths
