"""The lookup task: the facts table and its tool, the split of keys, the prompt files, the cold-start
conversations (at most 5% call lookup) and the GSM8K reward scoring the value written as a final answer."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import yaml

from megatron_gptoss.agent.calls import ToolCall, run_call
from megatron_gptoss.agent.tools import ToolRegistry
from megatron_gptoss.config.agent import AgentConfig, SandboxConfig
from megatron_gptoss.config.data import DataConfig
from megatron_gptoss.config.reward import RewardConfig
from megatron_gptoss.data.conversations import conversation_examples
from megatron_gptoss.envs import lookup
from megatron_gptoss.envs.dataset import DatasetTask
from megatron_gptoss.harmony import get_tokenizer, parse_completion, render_conversation, render_prompt

ROOT = Path(__file__).resolve().parents[2]


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lookup")
    lookup.write_files(out, sft=400, seed=3)
    return out


@pytest.fixture(scope="module")
def files(data_dir) -> dict[str, list[dict]]:
    return {name: jsonl(data_dir / f"{name}.jsonl") for name in ("train", "test", "sft")}


def test_table_values_are_single_tokens_and_fixed():
    tok = get_tokenizer()
    values = [lookup.value(k) for k in lookup.KEYS]
    assert all(lookup.VALUE_LOW <= v <= lookup.VALUE_HIGH for v in values)
    assert len(set(values)) > 100  # a hash, not a formula of the key
    assert sum(v == int(k) for k, v in zip(lookup.KEYS, values)) < 5
    for key in lookup.KEYS:
        assert len(tok.encode(key)) == 1 and len(tok.encode(str(lookup.value(key)))) == 1
    # the salt is part of the table: a value equals the salted hash's, independently recomputed
    import hashlib

    digest = hashlib.blake2b(f"{lookup.SALT}:value:217".encode(), digest_size=8).digest()
    assert lookup.value("217") == 100 + int.from_bytes(digest, "big") % 200


def test_lookup_tool_answers_and_refuses_unknown_keys():
    assert lookup.lookup("217") == str(lookup.value("217"))
    for bad in ("99", "300", "abc", " 217", ""):
        assert lookup.lookup(bad).startswith("error: no key") and repr(bad) in lookup.lookup(bad)
    with pytest.raises(KeyError):
        lookup.value("300")


def test_lookup_through_the_agent_tools():
    registry = ToolRegistry.from_config(
        AgentConfig(builtin_tools=[], tools=[lookup.tool_spec()]), SandboxConfig()
    )
    options = {"timeout_s": 5.0, "budget_left": True, "max_chars": 100}
    call = ToolCall("functions.lookup", "commentary", "<|constrain|>json", '{"key": "250"}')
    outcome = run_call(registry, call, **options)
    assert outcome.status == "ok" and outcome.text == str(lookup.value("250"))
    wrong = ToolCall("functions.lookup", "commentary", "<|constrain|>json", '{"key": 250}')
    assert run_call(registry, wrong, **options).status == "error"


def test_slow_lookup_answers_as_lookup_after_half_a_second_to_two():
    """Its wait is fixed by the key, spread over [0.5, 2] s; through the agent tools a call takes it and
    answers what lookup answers."""
    waits = [lookup.tool_latency(k) for k in lookup.KEYS]
    assert all(0.5 <= w <= 2.0 for w in waits) and min(waits) < 0.6 and max(waits) > 1.9
    assert waits == [lookup.tool_latency(k) for k in lookup.KEYS]
    spec = {**lookup.tool_spec(), "function": "megatron_gptoss.envs.lookup:slow_lookup"}
    registry = ToolRegistry.from_config(AgentConfig(builtin_tools=[], tools=[spec]), SandboxConfig())
    key = min(lookup.KEYS, key=lookup.tool_latency)  # the quickest key keeps the test short
    call = ToolCall("functions.lookup", "commentary", "<|constrain|>json", json.dumps({"key": key}))
    outcome = run_call(registry, call, timeout_s=5.0, budget_left=True, max_chars=100)
    assert outcome.status == "ok" and outcome.text == lookup.lookup(key)
    assert outcome.latency_s >= lookup.tool_latency(key), (outcome.latency_s, lookup.tool_latency(key))


def test_split_is_fixed_and_disjoint(files):
    held_out, train = set(lookup.split_keys(True)), set(lookup.split_keys(False))
    assert not held_out & train and held_out | train == set(lookup.KEYS)
    assert len(held_out) == 43
    test_keys = [r["extra_info"]["key"] for r in files["test"]]
    train_keys = [r["extra_info"]["key"] for r in files["train"]]
    assert sorted(test_keys) == sorted(held_out) and sorted(train_keys) == sorted(train)
    for r in files["train"] + files["test"]:
        key = r["extra_info"]["key"]
        assert f"key {key}" in r["prompt"][0]["content"]
        assert r["reward_model"]["ground_truth"] == str(lookup.value(key))


def lookup_calls(conversation: dict) -> list[dict]:
    return [m for m in conversation["messages"] if m.get("recipient") == "functions.lookup"]


def test_cold_start_calls_lookup_in_at_most_five_percent(files):
    sft = files["sft"]
    assert len(sft) == 400
    calling = [c for c in sft if lookup_calls(c)]
    assert 0 < len(calling) <= 0.05 * len(sft)
    calculator = [c for c in sft if any(m.get("recipient") == "functions.calculator" for m in c["messages"])]
    assert 0.7 * len(sft) < len(calculator) < 0.9 * len(sft)
    held_out = set(lookup.split_keys(True))
    for c in sft:
        question = c["messages"][0]["content"]
        if "key" in question:  # no held-out key is asked about, and no answer gives a held-out value
            key = question.split("key ")[1][:3]
            assert key not in held_out
            final = c["messages"][-1]["content"]
            assert (final == lookup.ANSWER.format(value=lookup.value(key))) == bool(lookup_calls(c))
            if not lookup_calls(c):  # a direct answer: no number at all
                assert final == lookup.UNKNOWN and not any(ch.isdigit() for ch in final)
    for c in calling:
        (call,) = lookup_calls(c)
        key = json.loads(call["content"])["key"]
        assert c["messages"][2] == {"role": "tool", "name": "lookup", "content": str(lookup.value(key))}
    with pytest.raises(ValueError, match="lookup_fraction"):
        lookup.conversations(10, 0, lookup_fraction=0.06)


def test_cold_start_prompts_are_the_rollout_prompts(files):
    """A conversation's trained turn starts from the prompt the agentic rollouts render for its question
    (the same tools in the developer message), and the trained tokens are the model's only."""
    calling = next(c for c in files["sft"] if lookup_calls(c))
    (example,) = conversation_examples(calling, "low", 0)
    registry = ToolRegistry.from_config(
        AgentConfig(builtin_tools=["calculator"], tools=[lookup.tool_spec()]), SandboxConfig()
    )
    prompt = render_prompt(calling["messages"][:1], reasoning_effort="low", **registry.prompt_keywords())
    assert example.prompt == prompt
    tok = get_tokenizer()
    trained = tok.decode(i for i, m in zip(example.token_ids, example.trained) if m)
    key = json.loads(lookup_calls(calling)[0]["content"])["key"]
    value = str(lookup.value(key))
    assert (
        "functions.lookup" in trained
        and f'"key": "{key}"' in trained
        and trained.endswith(lookup.ANSWER.format(value=value) + "<|return|>")
    )
    assert "to=assistant" not in trained  # the tool's message is context


def test_config_offers_the_tool_as_the_cold_start_lists_it():
    cfg = yaml.safe_load((ROOT / "configs/demo_lookup.yaml").read_text())
    assert cfg["agent"]["tools"] == [lookup.tool_spec()]
    assert cfg["agent"]["builtin_tools"] == ["calculator"]


@pytest.mark.parametrize(
    ("final", "reward"), [("{value}", 1.0), ("{wrong}", 0.0), ("The value is {value}.", 1.0), ("{key}", 0.0)]
)
def test_gsm8k_reward_scores_the_final_answer(data_dir, final, reward):
    """The dataset task (GSM8K reward in a worker) on a held-out row: the value as the final answer scores
    1 and another number (the key among them) 0, answered directly or after a lookup call and its result
    (the agentic trajectory as one stream); a completion without a final message scores 0."""
    task = DatasetTask(
        DataConfig(train_files=[str(data_dir / "train.jsonl")], eval_files=[str(data_dir / "test.jsonl")]),
        RewardConfig(name="gsm8k", workers=1),
        eval_size=43,
    )
    try:
        row = task.eval_prompts()[0]
        key, value = row.extra_info["key"], int(row.ground_truth)
        assert value == lookup.value(key) and row.messages[-1]["content"].count(key) == 1
        wrong = value + 1 if value < lookup.VALUE_HIGH else value - 1
        text = final.format(value=value, wrong=wrong, key=key)
        call = [
            {"role": "assistant", "recipient": "functions.lookup", "content": json.dumps({"key": key})},
            {"role": "tool", "name": "lookup", "content": lookup.lookup(key)},
        ]
        answers = {
            "direct": [{"role": "assistant", "channel": "final", "content": text}],
            "after a call": [*call, {"role": "assistant", "channel": "final", "content": text}],
            "no final": [*call, {"role": "assistant", "channel": "analysis", "content": text}],
        }
        responses = []
        for turn in answers.values():
            rendered = render_conversation([*row.messages, *turn], reasoning_effort="low")
            responses.append(rendered.token_ids[rendered.num_prompt_tokens :])
        assert parse_completion(responses[1])[-1]["content"] == text
        scores, _ = task.score_batch([row] * 3, responses)
        assert [s["reward"] for s in scores] == [reward, reward, 0.0]
    finally:
        task.close()


def test_conversations_are_a_pure_function_of_count_and_seed():
    assert lookup.conversations(40, 1) == lookup.conversations(40, 1)
    assert lookup.conversations(40, 1) != lookup.conversations(40, 2)
    question = lookup.question("217", random.Random(0))
    assert "217" in question


def _copy_distances(conversation: dict) -> tuple[int, int, int]:
    """(distance from the question's first copied number to the query that writes it into the call's
    arguments, distance from the tool's result to the query that writes the final answer's number, distance
    from the call's first copied number to that query), in tokens."""
    (example,) = conversation_examples(conversation, "low", 0)
    ids, trained = example.token_ids, example.trained
    arguments = json.loads(conversation["messages"][1]["content"])
    number = get_tokenizer().encode(str(arguments.get("key") or arguments["expression"].split()[0]))
    result = get_tokenizer().encode(conversation["messages"][2]["content"])
    assert len(number) == len(result) == 1
    # the question's last number (the tools' text and the arithmetic question's "100" / "200" come before it)
    in_question = max(i for i in range(example.num_prompt_tokens) if ids[i] == number[0])
    response = range(example.num_prompt_tokens, len(ids))
    in_call = next(i for i in response if trained[i] and ids[i] == number[0])
    in_result = max(i for i in range(len(ids)) if ids[i] == result[0] and not trained[i])
    in_answer = max(i for i in response if trained[i] and ids[i] == result[0])
    return in_call - 1 - in_question, in_answer - 1 - in_result, in_answer - 1 - in_call


def test_sliding_layer_sees_the_numbers_a_turn_copies():
    """The demo's sliding-window layer (query i sees i - W < j <= i) sees, from the query writing a call's
    argument, the question's number, at the same distance for a lookup call and a calculator call (their
    questions end with the number the call copies), and from the query writing the final answer's number,
    the tool's result but not the number in the call's arguments."""
    window = yaml.safe_load((ROOT / "configs/demo_lookup.yaml").read_text())["model"]["sliding_window"]
    rng = random.Random(0)
    lookups = {_copy_distances(lookup.lookup_call(k, rng)) for k in lookup.split_keys(False)[:20]}
    calculations = {_copy_distances(lookup.calculation(rng)) for _ in range(40)}
    copies = {d[:2] for d in lookups | calculations}
    assert len(lookups) == 1 and len(copies) == 1, (lookups, calculations)
    ((argument, answer),) = copies
    assert 0 < answer < argument < window
    assert all(d[2] >= window for d in lookups | calculations)
