import random

import pytest
from conversations import LOOKUP

from megatron_gptoss.harmony import (
    CALL,
    CHANNEL,
    CONSTRAIN,
    END,
    MESSAGE,
    RETURN,
    START,
    VOCAB_SIZE,
    ParsedCompletion,
    get_tokenizer,
    parse_completion,
    render_conversation,
)

USER = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Population of Oslo?"}]
TURNS = {
    "final": [{"role": "assistant", "content": "709,000."}],
    "analysis, final": [
        {"role": "assistant", "channel": "analysis", "content": "Recall: about 709k.\n"},
        {"role": "assistant", "content": "About **709,000** 🙂"},
    ],
    "analysis, call": [
        {"role": "assistant", "channel": "analysis", "content": "Look it up."},
        {"role": "assistant", "recipient": "functions.lookup", "content": '{"query": "Oslo", "lang": "en"}'},
    ],
    "preamble, call": [
        {"role": "assistant", "channel": "analysis", "content": "Need the tool."},
        {"role": "assistant", "channel": "commentary", "content": "Checking <|start|> the <|end|> data."},
        {"role": "assistant", "recipient": "functions.lookup", "content": "{}"},
    ],
    "lookalikes": [{"role": "assistant", "content": "<|channel|>final<|message|>x<|return|>"}],
}


def _completion(turn, placement):
    rendered = render_conversation(USER + turn, tools=[LOOKUP], recipient_placement=placement)
    return rendered.token_ids[rendered.num_prompt_tokens :]


def _expected(turn):
    out = []
    for m in turn:
        call = m.get("recipient") is not None
        out.append(
            {
                "role": "assistant",
                "name": None,
                "channel": m.get("channel", "commentary" if call else "final"),
                "recipient": m.get("recipient"),
                "content_type": "<|constrain|>json" if call else None,
                "content": m["content"],
                "end": ("call" if call else "return") if m is turn[-1] else "end",
            }
        )
    return out


@pytest.mark.parametrize("placement", ["channel", "header"])
@pytest.mark.parametrize("name", list(TURNS))
def test_parse_inverts_rendering(name, placement):
    parsed = parse_completion(_completion(TURNS[name], placement))
    assert isinstance(parsed, ParsedCompletion) and parsed.error is None and parsed.ok
    assert list(parsed) == _expected(TURNS[name])


@pytest.mark.parametrize("name", list(TURNS))
def test_parse_agrees_with_the_reference_parser(reference, name):
    oh, enc, placement = reference
    ids = _completion(TURNS[name], placement)
    ref = enc.parse_messages_from_completion_tokens(ids, oh.Role.ASSISTANT)
    ours = parse_completion(ids)
    assert len(ours) == len(ref)
    for o, r in zip(ours, ref):
        assert (o["channel"], o["recipient"], o["content_type"]) == (r.channel, r.recipient, r.content_type)
        assert o["content"] == "".join(c.text for c in r.content)


def test_model_written_headers():
    tok = get_tokenizer()
    enc = tok.encode
    header = [*enc(" to=functions.lookup"), CHANNEL, *enc("commentary"), *enc(" "), CONSTRAIN, *enc("json")]
    after = [CHANNEL, *enc("commentary to=functions.lookup json")]  # bare content type, one text piece
    for head in (header, after):
        parsed = parse_completion([*head, MESSAGE, *enc('{"query": "x"}'), CALL])
        assert parsed.ok, parsed.error
        assert parsed[0]["recipient"] == "functions.lookup" and parsed[0]["channel"] == "commentary"
        assert parsed[0]["content"] == '{"query": "x"}' and parsed[0]["end"] == "call"
    # a tool's message inside a completion parses with its name as author
    ids = [CHANNEL, *enc("analysis"), MESSAGE, *enc("a"), END, START, *enc("functions.lookup to=assistant")]
    ids += [CHANNEL, *enc("commentary"), MESSAGE, *enc("42"), END]
    parsed = parse_completion(ids)
    assert parsed[1]["role"] == "tool" and parsed[1]["name"] == "functions.lookup"
    assert parsed[1]["recipient"] == "assistant" and parsed.error.startswith("truncated after <|end|>")


def test_malformed_completions_give_reasons():
    enc = get_tokenizer().encode
    final = [CHANNEL, *enc("final"), MESSAGE, *enc("4"), RETURN]
    cases = {
        "empty": [],
        "header": [CHANNEL, *enc("final")],
        "content": [CHANNEL, *enc("final"), MESSAGE, *enc("trunc")],
        "after": final + enc(" more"),
        "start": [CHANNEL, *enc("analysis"), MESSAGE, END, *enc("oops")],
        "vocab": [CHANNEL, *enc("final"), MESSAGE, VOCAB_SIZE + 5, RETURN],
        "negative": [-1],
        "author": [CHANNEL, *enc("analysis"), MESSAGE, END, START, *enc("robot"), MESSAGE, END],
        "channel": [CHANNEL, MESSAGE, RETURN],
        "stray end": [CHANNEL, END, *enc("final"), MESSAGE, RETURN],
        "not ints": ["a", None],
    }
    for name, ids in cases.items():
        parsed = parse_completion(ids)
        assert isinstance(parsed.error, str) and parsed.error, name
    assert parse_completion(final).ok
    assert parse_completion(cases["content"])[0] == {
        "role": "assistant",
        "name": None,
        "channel": "final",
        "recipient": None,
        "content_type": None,
        "content": "trunc",
        "end": None,
    }


def test_random_and_truncated_streams_never_raise():
    rng = random.Random(1234)
    specials = [START, END, MESSAGE, CHANNEL, RETURN, CALL, CONSTRAIN, 199999, 200018, VOCAB_SIZE - 1]
    valid = [_completion(turn, p) for turn in TURNS.values() for p in ("channel", "header")]
    for ids in valid:
        assert parse_completion(ids).ok
        for cut in range(len(ids)):  # every proper prefix is truncated
            assert parse_completion(ids[:cut]).error is not None
    for _ in range(1500):
        kind = rng.randrange(3)
        if kind == 0:  # random ids, specials over-represented, some outside the vocabulary
            n = rng.randrange(0, 40)
            ids = [
                rng.choice(specials) if rng.random() < 0.3 else rng.randrange(-3, VOCAB_SIZE + 3)
                for _ in range(n)
            ]
        else:  # a valid completion with tokens replaced, inserted or deleted
            ids = list(rng.choice(valid))
            for _ in range(rng.randrange(1, 4)):
                i = rng.randrange(len(ids) + 1)
                tok = rng.choice(specials) if rng.random() < 0.5 else rng.randrange(VOCAB_SIZE)
                if kind == 1 and i < len(ids):
                    ids[i] = tok
                elif rng.random() < 0.5:
                    ids.insert(i, tok)
                elif ids:
                    del ids[min(i, len(ids) - 1)]
        parsed = parse_completion(ids)
        assert isinstance(parsed, ParsedCompletion)
        assert parsed.error is None or isinstance(parsed.error, str)
        for msg in parsed:
            assert isinstance(msg["content"], str) and msg["end"] in ("end", "return", "call", None)
        if parsed.ok:
            assert parsed[-1]["end"] in ("return", "call")


def test_a_multi_turn_trajectory_parses_whole():
    """An agentic trajectory (a call, the tool's result, the next turn's final answer) parses as its four
    messages, equal to the conversation rendered by `render_conversation`; a call followed by anything but
    `<|start|>` is still an error, and a trajectory cut inside the tool's message is truncated."""
    messages = [
        {"role": "user", "content": "What is the value of key 417?"},
        {"role": "assistant", "channel": "analysis", "content": "Look it up."},
        {"role": "assistant", "recipient": "functions.lookup", "content": '{"key": "417"}'},
        {"role": "tool", "name": "lookup", "content": "482"},
        {"role": "assistant", "channel": "final", "content": "482"},
    ]
    for placement in ("channel", "header"):
        rendered = render_conversation(messages, reasoning_effort="low", recipient_placement=placement)
        response = rendered.token_ids[rendered.num_prompt_tokens :]
        parsed = parse_completion(response)
        assert parsed.ok, parsed.error
        assert [(m["role"], m["channel"], m["recipient"], m["content"], m["end"]) for m in parsed] == [
            ("assistant", "analysis", None, "Look it up.", "end"),
            ("assistant", "commentary", "functions.lookup", '{"key": "417"}', "call"),
            ("tool", "commentary", "assistant", "482", "end"),
            ("assistant", "final", None, "482", "return"),
        ]
        assert parsed[2]["name"] == "functions.lookup"
        call_end = response.index(CALL) + 1
        assert parse_completion(response[:call_end]).ok
        assert "after <|call|>" in parse_completion([*response[:call_end], END]).error
        assert parse_completion(response[: call_end + 3]).error.startswith("truncated")
