"""A task a small model can solve only through a tool: a table of facts it cannot know, read by `lookup`.

table      keys "100" ... "299"; the value of a key is a keyed hash of it (salted BLAKE2b) mapped to
           100 ... 299. Keys and values are each one o200k_harmony token, so a call copies the key
           from the question and the answer copies the value from the tool's result. Keys and values
           share one small range, which the cold start's arithmetic covers: a small model copies a
           token well only once it has learnt to write it.
lookup     the tool: `lookup(key: str) -> str`, the value as text, or an "error: ..." string for an
           unknown key; `tool_spec()` is its `agent.tools` entry (name, function, description, schema);
           `slow_lookup` the same after 0.5-2 s (by key), a tool as slow as a sandboxed python call.
splits     held-out keys: those whose (separately salted) hash falls in HELD_OUT_BUCKETS of BUCKETS
           buckets (43 of the 200 keys); training keys are the rest. The split is fixed, whatever
           the seeds.
rows       verl's schema: the question as the one user message, the value as the ground truth, so
           the GSM8K reward on the final answer scores it (`reward.name: gsm8k`).
cold start harmony conversations: arithmetic questions answered through the calculator (the call
           format, on a different tool, with the same two copies as a lookup call: the question's number
           into the arguments, the tool's result into the answer, "The value is N."), questions on
           training keys answered directly with "I do not know." (no number: the only number a final
           answer writes is a copy of a tool's result), and at most `MAX_LOOKUP_FRACTION` of the
           conversations calling `lookup` (then answering with its result). Every conversation lists
           the tools the agentic rollouts offer (`agent.builtin_tools: [calculator]` and `lookup`), so
           its prompt is the rollouts' prompt.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
import time
from pathlib import Path
from typing import Any

from megatron_gptoss.agent.tools import ToolRegistry
from megatron_gptoss.config.agent import AgentConfig, SandboxConfig

NAME = "lookup"
# The salt of the table: a different salt is a different table.
SALT = "megatron-gptoss/lookup/v1"
KEYS = tuple(str(k) for k in range(100, 300))
KEY_SET = frozenset(KEYS)
# Values lie in [VALUE_LOW, VALUE_HIGH].
VALUE_LOW, VALUE_HIGH = 100, 299
# The held-out keys: those hashing into HELD_OUT_BUCKETS of BUCKETS buckets.
BUCKETS = 5
HELD_OUT_BUCKETS = 1
# A direct answer to a question on a key: the model cannot know the value.
UNKNOWN = "I do not know."
# A final answer after a tool's result: the number comes after four tokens, so the query writing it sits 10
# tokens after the tool's result, inside the demo's sliding window (20), and 23 after the key in the call's
# arguments, outside it: that layer sees one number to copy. (Answering with the bare number, the key was 17
# back, in the window, and the cold start copied it instead of the result 12-26% of the time.)
ANSWER = "The value is {value}."
# The largest share of cold-start conversations that may call the lookup tool.
MAX_LOOKUP_FRACTION = 0.05
DESCRIPTION = "Returns the value stored under a key of the facts table."
PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"key": {"type": "string", "description": "A key of the table, e.g. 217"}},
    "required": ["key"],
    "additionalProperties": False,
}
# One wording: the key stands at the same place in every question.
QUESTIONS = ("What is the value of key {key}?",)
# The arithmetic question ends with the number the call copies first, from the same distance as a lookup call
# copies its key (the calculator's name is a token longer than lookup's, the question has no "?"). Its result,
# like a lookup value, is no function of the question a small model can learn (a product of two numbers
# modulo 200, 40,000 pairs), so the final answer has to copy the tool's result, as after a lookup. (With
# a one-number result, a square modulo 200, the cold start memorised the results and copied a lookup's value
# less often.)
ARITHMETIC = "Compute 100 plus the product modulo 200 of {b} and {a}"
EXPRESSION = "{a} * {b} % 200 + 100"


def _hash(kind: str, key: str) -> int:
    digest = hashlib.blake2b(f"{SALT}:{kind}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def value(key: str) -> int:
    """The value of `key` (one of KEYS); KeyError for any other string."""
    if key not in KEY_SET:
        raise KeyError(key)
    return VALUE_LOW + _hash("value", key) % (VALUE_HIGH - VALUE_LOW + 1)


def lookup(key: str) -> str:
    """The tool: the value of `key` as text, or an error message naming the key when the table has none."""
    if key not in KEY_SET:
        return f"error: no key {key!r} in the table (keys are {KEYS[0]} to {KEYS[-1]})"
    return str(value(key))


# `slow_lookup`: a call takes between these many seconds (a sandboxed python call's range), by key.
SLOW_S = (0.5, 2.0)


def tool_latency(key: str) -> float:
    """The seconds `slow_lookup` takes on `key`: spread over SLOW_S by a hash of it (fixed, whatever the
    seeds, so runs that differ in their setting wait alike)."""
    low, high = SLOW_S
    return low + (high - low) * (_hash("latency", key) % 1001) / 1000


def slow_lookup(key: str) -> str:
    """`lookup` that answers after `tool_latency(key)` seconds: the lookup task with a tool as slow as real
    ones, for asynchronous rollouts to hide (`benchmarks/bench_async.py --lookup --slow-tool`)."""
    time.sleep(tool_latency(key))
    return lookup(key)


def tool_spec() -> dict[str, Any]:
    """The `agent.tools` entry of the lookup tool."""
    return {
        "name": NAME,
        "function": f"{__name__}:lookup",
        "description": DESCRIPTION,
        "parameters": PARAMETERS,
    }


def is_held_out(key: str) -> bool:
    return _hash("split", key) % BUCKETS < HELD_OUT_BUCKETS


@functools.cache
def split_keys(held_out: bool) -> tuple[str, ...]:
    """The keys of one split, in table order."""
    return tuple(k for k in KEYS if is_held_out(k) == held_out)


@functools.cache
def rollout_tools() -> tuple[dict[str, Any], ...]:
    """The function tools as the agentic rollouts list them in the developer message (the calculator, then
    lookup: `agent.builtin_tools: [calculator]`, `agent.tools: [tool_spec()]`)."""
    agent = AgentConfig(builtin_tools=["calculator"], tools=[tool_spec()])
    tools = ToolRegistry.from_config(agent, SandboxConfig()).prompt_keywords()["tools"]
    return tuple(tools or ())


def question(key: str, rng: random.Random) -> str:
    return rng.choice(QUESTIONS).format(key=key)


def row(key: str, rng: random.Random) -> dict[str, Any]:
    """A prompt row in verl's schema; the ground truth is the value."""
    return {
        "prompt": [{"role": "user", "content": question(key, rng)}],
        "data_source": "lookup",
        "reward_model": {"ground_truth": str(value(key)), "style": "rule"},
        "extra_info": {"key": key, "held_out": is_held_out(key)},
    }


def _conversation(messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {"messages": messages, "tools": [dict(t) for t in rollout_tools()]}


def lookup_call(key: str, rng: random.Random) -> dict[str, Any]:
    """A conversation that calls lookup on `key` and answers with the result."""
    result = lookup(key)
    return _conversation(
        [
            {"role": "user", "content": question(key, rng)},
            {"role": "assistant", "recipient": f"functions.{NAME}", "content": json.dumps({"key": key})},
            {"role": "tool", "name": NAME, "content": result},
            {"role": "assistant", "channel": "final", "content": ANSWER.format(value=result)},
        ]
    )


def direct_answer(key: str, rng: random.Random) -> dict[str, Any]:
    """A conversation that answers a question on `key` directly: without the tool the model cannot know the
    value, so it says so (`UNKNOWN`, scored 0). No number is written, so the only number a final answer
    of the cold start writes is a copy of a tool's result."""
    return _conversation(
        [
            {"role": "user", "content": question(key, rng)},
            {"role": "assistant", "channel": "final", "content": UNKNOWN},
        ]
    )


def calculation(rng: random.Random) -> dict[str, Any]:
    """An arithmetic question answered through the calculator: 100 + a * b mod 200 for key-range a and b (a
    result in the value range), so the conversation makes the two copies a lookup call makes: the question's
    last number into the call's arguments, the tool's result into the final answer (and writes every key and
    value token)."""
    a, b = rng.randint(VALUE_LOW, VALUE_HIGH), rng.randint(VALUE_LOW, VALUE_HIGH)
    result = str(100 + a * b % 200)
    return _conversation(
        [
            {"role": "user", "content": ARITHMETIC.format(a=a, b=b)},
            {
                "role": "assistant",
                "recipient": "functions.calculator",
                "content": json.dumps({"expression": EXPRESSION.format(a=a, b=b)}),
            },
            {"role": "tool", "name": "calculator", "content": result},
            {"role": "assistant", "channel": "final", "content": ANSWER.format(value=result)},
        ]
    )


def conversations(
    count: int, seed: int, lookup_fraction: float = MAX_LOOKUP_FRACTION, arithmetic_fraction: float = 0.8
) -> list[dict[str, Any]]:
    """`count` cold-start conversations, shuffled: round(count * arithmetic_fraction) calculator ones,
    floor(count * lookup_fraction) lookup calls on training keys, direct answers (UNKNOWN) to questions on
    training keys for the rest.
    ValueError when `lookup_fraction` exceeds MAX_LOOKUP_FRACTION or the fractions exceed 1."""
    if not 0 <= lookup_fraction <= MAX_LOOKUP_FRACTION:
        raise ValueError(f"lookup_fraction={lookup_fraction} must be in [0, {MAX_LOOKUP_FRACTION}]")
    if not 0 <= arithmetic_fraction <= 1 - lookup_fraction:
        raise ValueError(f"arithmetic_fraction={arithmetic_fraction} must be in [0, 1 - lookup_fraction]")
    rng = random.Random(f"lookup-cold-start:{seed}")
    keys = split_keys(held_out=False)
    arithmetic = round(count * arithmetic_fraction)
    calls = int(count * lookup_fraction)
    out = [calculation(rng) for _ in range(arithmetic)]
    out += [lookup_call(rng.choice(keys), rng) for _ in range(calls)]
    out += [direct_answer(rng.choice(keys), rng) for _ in range(count - arithmetic - calls)]
    rng.shuffle(out)
    return out


def rows(held_out: bool, seed: int) -> list[dict[str, Any]]:
    """One row per key of the split, in a seeded order."""
    rng = random.Random(f"lookup-rows:{seed}:{held_out}")
    keys = list(split_keys(held_out))
    rng.shuffle(keys)
    return [row(key, rng) for key in keys]


def write_files(
    out_dir: str | Path,
    sft: int,
    seed: int = 0,
    lookup_fraction: float = MAX_LOOKUP_FRACTION,
    arithmetic_fraction: float = 0.8,
) -> list[Path]:
    """`out_dir`/train.jsonl (every training key), `out_dir`/test.jsonl (every held-out key) and
    `out_dir`/sft.jsonl (`sft` cold-start conversations); returns the three paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    contents = {
        "train.jsonl": rows(False, seed),
        "test.jsonl": rows(True, seed),
        "sft.jsonl": conversations(sft, seed, lookup_fraction, arithmetic_fraction),
    }
    paths = []
    for name, lines in contents.items():
        path = out / name
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        paths.append(path)
    return paths
