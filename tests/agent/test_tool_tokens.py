"""Tool calls from model tokens to result tokens: the loop's stream equals openai-harmony's rendering of
the conversation, and its mask equals the training renderer's."""

import json

import pytest

from megatron_gptoss.agent import ToolRegistry, parse_tool_call, run_call, tool_result_tokens
from megatron_gptoss.config import AgentConfig, SandboxConfig
from megatron_gptoss.harmony import CALL, CHANNEL, MESSAGE, get_tokenizer, render_conversation, render_prompt

USER_TOOLS = [
    {
        "name": "lookup",
        "function": "helpers_tools:lookup",
        "description": "Looks a key up in the fact table.",
        "parameters": {
            "type": "object",
            "properties": {"key": {"type": "string", "description": "the key"}},
            "required": ["key"],
        },
    },
    {
        "name": "add",
        "function": "helpers_tools:add",
        "description": "Adds two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
    {"name": "broken", "function": "helpers_tools:broken", "parameters": {"type": "object"}},
]


@pytest.fixture(scope="module")
def registry(sandbox_launcher):
    cfg = AgentConfig(tools=USER_TOOLS)
    cfg.validate()
    return ToolRegistry.from_config(cfg, SandboxConfig(), sandbox_launcher)


def _reference_conversation(oh, registry, user, turn):
    """The openai_harmony Conversation of `user` then `turn` ([(kind, fields)]), built independently."""
    keywords = registry.prompt_keywords()
    system = oh.SystemContent.new()
    if keywords["builtin_tools"]:
        config = oh.ToolNamespaceConfig(
            name="python", description=keywords["builtin_tools"]["python"], tools=[]
        )
        system = system.with_tools(config)
    dev = oh.DeveloperContent.new().with_function_tools(
        [
            oh.ToolDescription.new(
                t["function"]["name"], t["function"]["description"], t["function"].get("parameters")
            )
            for t in keywords["tools"]
        ]
    )
    messages = [
        oh.Message.from_role_and_content(oh.Role.SYSTEM, system),
        oh.Message.from_role_and_content(oh.Role.DEVELOPER, dev),
        oh.Message.from_role_and_content(oh.Role.USER, user),
    ]
    for kind, f in turn:
        if kind == "assistant":
            m = oh.Message.from_role_and_content(oh.Role.ASSISTANT, f["content"]).with_channel(f["channel"])
            if f.get("recipient"):
                m = m.with_recipient(f["recipient"]).with_content_type(f["content_type"])
        else:
            author = oh.Author.new(oh.Role.TOOL, f["name"])
            m = oh.Message.from_author_and_content(author, f["content"]).with_channel(f["channel"])
            m = m.with_recipient("assistant")
        messages.append(m)
    return oh.Conversation.from_messages(messages)


def _model_writes(oh, enc, fields):
    """The tokens a model writes for one assistant message after the prompt's <|start|>assistant, as
    openai-harmony renders it."""
    m = oh.Message.from_role_and_content(oh.Role.ASSISTANT, fields["content"]).with_channel(fields["channel"])
    if fields.get("recipient"):
        m = m.with_recipient(fields["recipient"]).with_content_type(fields["content_type"])
    return enc.render(m)[2:]  # drop <|start|>assistant


def _call(recipient, content, channel="commentary", content_type="<|constrain|>json"):
    return {"channel": channel, "recipient": recipient, "content": content, "content_type": content_type}


CHAINS = {
    "function_call": [_call("functions.lookup", '{"key": "zorblat"}')],
    "calculator_then_add": [
        _call("functions.calculator", '{"expression": "2 ** 10 - 24"}'),
        _call("functions.add", '{"a": 1000, "b": 7}'),
    ],
    "python_on_analysis": [
        _call("python", "print(sum(range(101)))", channel="analysis", content_type="code")
    ],
    "malformed_then_good": [
        _call("functions.add", '{"a": 1, "b": '),
        _call("functions.nope", "{}"),
        _call("functions.add", '{"a": "one", "b": 2}'),
        _call("functions.broken", '{"x": 1}'),
        _call("functions.add", '{"a": 1, "b": 2}'),
    ],
}


@pytest.mark.parametrize("name", list(CHAINS))
def test_loop_stream_equals_reference_render(harmony_reference, registry, name):
    oh, enc = harmony_reference
    user = "Answer using the tools."
    keywords = registry.prompt_keywords()
    stream = render_prompt([{"role": "user", "content": user}], **keywords)
    mask = [False] * len(stream)
    turn, messages = [], [{"role": "user", "content": user}]
    for i, call_fields in enumerate(CHAINS[name]):
        thought = {"channel": "analysis", "content": f"Step {i}: I call a tool."}
        for fields in (thought, call_fields):
            written = _model_writes(oh, enc, fields)
            if fields is call_fields:
                call = parse_tool_call(written)
            else:
                written += [enc.encode("<|start|>assistant", allowed_special="all")[0]] + enc.encode(
                    "assistant"
                )
            stream += written
            mask += [True] * len(written)
        assert call is not None and call.recipient == call_fields["recipient"]
        outcome = run_call(registry, call, timeout_s=10.0, budget_left=True, max_chars=4096)
        appended = tool_result_tokens(stream, call, outcome)
        stream += appended
        mask += [False] * len(appended)
        result = {"name": call.recipient, "content": outcome.text, "channel": call.channel}
        turn += [("assistant", thought), ("assistant", call_fields), ("tool", result)]
        messages += [
            {"role": "assistant", **thought},
            {"role": "assistant", **call_fields},
            {"role": "tool", **result},
        ]
        # after every tool result the stream is the reference's prompt for the model's next turn
        expected = enc.render_conversation_for_completion(
            _reference_conversation(oh, registry, user, turn), oh.Role.ASSISTANT
        )
        assert stream == expected, (
            f"{name}:\nours {enc.decode_utf8(stream)!r}\nref  {enc.decode_utf8(expected)!r}"
        )
    trained = render_conversation(messages, **keywords)
    assert trained.token_ids == stream[:-2]  # the training stream, before the next <|start|>assistant
    assert trained.assistant_mask == mask[:-2]


def test_outcomes_of_each_chain(registry):
    def outcome(recipient, args, budget_left=True):
        call = parse_tool_call(_tokens(recipient, args))
        return run_call(registry, call, timeout_s=10.0, budget_left=budget_left, max_chars=4096)

    assert (outcome("functions.lookup", '{"key": "zorblat"}').text, "ok") == ("7341", "ok")
    assert outcome("functions.calculator", '{"expression": "2 ** 10 - 24"}').text == "1000"
    assert json.loads(outcome("functions.add", '{"a": 1000, "b": 7}').text) == {"sum": 1007}
    bad = {
        '{"a": 1, "b": ': "not valid JSON",
        '{"a": "one", "b": 2}': "arguments.a must be of type integer",
        '{"a": 1}': "missing the required property 'b'",
        '{"a": 1, "b": 2, "c": 3}': "unknown property 'c'",
    }
    for args, message in bad.items():
        got = outcome("functions.add", args)
        assert got.status == "error" and message in got.text, got.text
    assert "unknown tool 'functions.nope'" in outcome("functions.nope", "{}").text
    assert "RuntimeError: the tool's backend is down" in outcome("functions.broken", '{"x": 1}').text
    spent = outcome("functions.add", '{"a": 1, "b": 2}', budget_left=False)
    assert spent.status == "error" and "budget" in spent.text


def _tokens(recipient, args, placement="channel"):
    from megatron_gptoss.harmony.render import HarmonyMessage, render_message

    ids = render_message(
        HarmonyMessage("assistant", args, "commentary", recipient, "<|constrain|>json"), placement
    )
    return ids[2:]


def test_both_recipient_placements_parse_to_the_same_call():
    header, channel = _tokens("functions.add", '{"a": 1}', "header"), _tokens("functions.add", '{"a": 1}')
    assert header != channel
    assert parse_tool_call(header) == parse_tool_call(channel)
    assert parse_tool_call(channel).arguments == '{"a": 1}'
    assert parse_tool_call(channel[:-1]) is None  # no <|call|>: not a call


def test_a_call_on_an_unknown_channel_is_answered_on_commentary(registry):
    """A call whose channel harmony does not have (a sampled typo) is run and answered on commentary, the
    trajectory going on; it does not stop the rollout."""
    enc = get_tokenizer().encode
    ids = [CHANNEL, *enc("$total to=functions.calculator"), MESSAGE, *enc('{"expression": "2+3"}'), CALL]
    call = parse_tool_call(ids)
    assert call is not None and call.recipient == "functions.calculator" and call.channel == "commentary"
    outcome = run_call(registry, call, timeout_s=5.0, budget_left=True, max_chars=100)
    assert outcome.text == "5"
    text = get_tokenizer().decode(tool_result_tokens(ids, call, outcome))
    expected = "<|start|>functions.calculator<|channel|>commentary to=assistant<|message|>5<|end|>"
    assert text == expected + "<|start|>assistant"


def test_python_tool_timeout_and_output(registry):
    call = parse_tool_call(_tokens("python", "while True:\n    pass"))
    got = run_call(registry, call, timeout_s=1.0, budget_left=True, max_chars=4096)
    assert got.status == "timeout" and got.text.endswith("[timed out]")
    call = parse_tool_call(_tokens("python", "print('y' * 10000)"))
    got = run_call(registry, call, timeout_s=5.0, budget_left=True, max_chars=100)
    assert (
        got.status == "ok"
        and got.text.startswith("y" * 100)
        and got.text.endswith("[... 9901 characters cut]")
    )
