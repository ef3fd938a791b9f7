"""Harmony chat rendering: OpenAI-style message dicts -> o200k_harmony token ids.

Every token is what openai-harmony's renderer writes for the equivalent conversation (tests/harmony
compares them id for id). A conversation renders as

    system     <|start|>system<|message|>{identity, cutoff, date, reasoning effort, channels}<|end|>
    developer  <|start|>developer<|message|># Instructions ... # Tools ...<|end|>   (when either exists)
    user       <|start|>user<|message|>{content}<|end|>
    assistant  <|start|>assistant<|channel|>{analysis|commentary|final}<|message|>{content}<|end|>
    tool call  <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>
                   {json}<|call|>
    tool       <|start|>functions.NAME<|channel|>commentary to=assistant<|message|>{content}<|end|>

with the recipient (`to=...`) after a `commentary` channel and in the header on any other channel
(`recipient_placement="channel"`, oss-harmony 0.0.11's rendering, the default; it also writes every
content type as `<|constrain|>TYPE`), or always in the header right after the author (`"header"`,
openai-harmony 0.0.8's: `<|start|>assistant to=functions.NAME<|channel|>commentary <|constrain|>json`, a
bare content type as ` TYPE`). The built-in python tool is called on the analysis channel,
`<|start|>assistant to=python<|channel|>analysis <|constrain|>code<|message|>{code}<|call|>`, and answers
`<|start|>python to=assistant<|channel|>analysis<|message|>{output}<|end|>`. Header pieces are
tokenized one by one, as the reference does, so token boundaries match it too.

Analysis dropping (openai-harmony's default, `drop_analysis=True`): when the last assistant message is
on the `final` channel, the analysis messages before the conversation's first `final` message are left
out. The analysis of a tool-call chain still in progress (last assistant message not final) stays.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from megatron_gptoss.errors import MegatronGptossError
from megatron_gptoss.harmony.schema import rust_lines, tools_section
from megatron_gptoss.harmony.tokenizer import (
    CALL,
    CHANNEL,
    CONSTRAIN,
    END,
    MESSAGE,
    RETURN,
    START,
    get_tokenizer,
)

REASONING_EFFORTS = ("low", "medium", "high")
CHANNELS = ("analysis", "commentary", "final")
RECIPIENT_PLACEMENTS = ("channel", "header")
DEFAULT_RECIPIENT_PLACEMENT = "channel"
MODEL_IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
KNOWLEDGE_CUTOFF = "2024-06"
JSON_CONTENT_TYPE = "<|constrain|>json"
CONSTRAIN_TEXT = "<|constrain|>"
STOP_TOKENS = (RETURN, CALL)  # a rollout ends at a final answer or a tool call
# Built-in tools: listed in the system message (`# Tools` / `## NAME` / description), called by their bare
# name as recipient (`to=python`), answering as author NAME. The python tool's code has content type `code`.
BUILTIN_TOOLS = ("python",)


class HarmonyFormatError(MegatronGptossError, ValueError):
    """A message dict that cannot be rendered (unknown role or channel, a tool message without a name)."""


@dataclass(frozen=True)
class HarmonyMessage:
    """One harmony message. `author` is the role, or the tool's full name (`functions.lookup`) for a tool
    message; `recipient` is None or a full name (`functions.lookup`, `assistant`)."""

    author: str
    content: str
    channel: str | None = None
    recipient: str | None = None
    content_type: str | None = None

    @property
    def is_assistant(self) -> bool:
        return self.author == "assistant"


@dataclass(frozen=True)
class RenderedConversation:
    """A conversation rendered for training: `token_ids`, `assistant_mask[i]` (True for the tokens the
    assistant wrote in the trained turn: the only tokens to train on) and `num_prompt_tokens` (the
    tokens before the trained turn, ending with `<|start|>assistant`; `render_prompt` of the messages
    before the turn, id for id)."""

    token_ids: list[int]
    assistant_mask: list[bool]
    num_prompt_tokens: int


def stop_token_ids() -> list[int]:
    """The tokens that end a rollout: `<|return|>` (final answer) and `<|call|>` (tool call)."""
    return list(STOP_TOKENS)


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: [{"type": "text", "text": ...}, ...]
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, Mapping) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise HarmonyFormatError(f"content part {part!r} has no text")
        return "".join(parts)
    raise HarmonyFormatError(f"message content must be a string or a list of text parts, got {content!r}")


def _arguments(args: Any) -> str:
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def _full_name(name: str) -> str:
    """`lookup` -> `functions.lookup`; a dotted name and the built-in `python` stay as they are."""
    return name if "." in name or name in BUILTIN_TOOLS else f"functions.{name}"


def _function_tools(tools: Sequence[Mapping] | None) -> list[dict]:
    out = []
    for tool in tools or ():
        fn = tool.get("function", tool) if tool.get("type", "function") == "function" else None
        if fn is None or not isinstance(fn.get("name"), str):
            raise HarmonyFormatError(f"tool {tool!r} is not a function tool with a name")
        out.append(
            {
                "name": fn["name"],
                "description": fn.get("description") or "",
                "parameters": fn.get("parameters"),
            }
        )
    return out


def to_harmony_messages(
    messages: Sequence[Mapping],
    *,
    reasoning_effort: str = "medium",
    tools: Sequence[Mapping] | None = None,
    conversation_start_date: str | None = None,
    knowledge_cutoff: str = KNOWLEDGE_CUTOFF,
    model_identity: str = MODEL_IDENTITY,
    builtin_tools: Mapping[str, str] | None = None,
) -> list[HarmonyMessage]:
    """The harmony messages of an OpenAI-style conversation, system and developer messages first.

    - `system` / `developer` dicts: their texts, joined by a blank line, become the developer message's
      instructions (wherever they stand); the harmony system message is always generated.
    - `user`: as is. `assistant`: on `channel` (default `final`); with `recipient` (e.g.
      `functions.lookup`) it is a tool call: channel `commentary` unless given, content type
      `<|constrain|>json` unless `content_type` is given. OpenAI `tool_calls`
      (`[{"function": {"name", "arguments"}}]`) become one such call each, after the message's own
      content (if any).
    - `tool`: `name` (a bare name gets `functions.`, except a built-in tool's), or the name of the call
      whose id is `tool_call_id`; sent to the assistant on `channel` (default `commentary`; a tool answers
      on the channel it was called on).

    `builtin_tools` ({name: description}, names from BUILTIN_TOOLS) are listed in the system message.
    """
    if reasoning_effort not in REASONING_EFFORTS:
        raise HarmonyFormatError(
            f"reasoning_effort must be one of {REASONING_EFFORTS}, got {reasoning_effort!r}"
        )
    fn_tools = _function_tools(tools)
    instructions: list[str] = []
    body: list[HarmonyMessage] = []
    call_names: dict[str, str] = {}
    for i, msg in enumerate(messages):
        role = msg.get("role")
        if role in ("system", "developer"):
            instructions.append(_text(msg.get("content")))
        elif role == "user":
            body.append(HarmonyMessage("user", _text(msg.get("content"))))
        elif role == "assistant":
            body.extend(_assistant(msg, call_names))
        elif role == "tool":
            name = msg.get("name") or call_names.get(str(msg.get("tool_call_id")))
            if not isinstance(name, str) or not name:
                raise HarmonyFormatError(f"tool message {i} has neither a name nor a known tool_call_id")
            channel = msg.get("channel") or "commentary"
            if channel not in CHANNELS:
                raise HarmonyFormatError(f"tool message {i} has channel {channel!r}, not one of {CHANNELS}")
            body.append(HarmonyMessage(_full_name(name), _text(msg.get("content")), channel, "assistant"))
        else:
            raise HarmonyFormatError(f"message {i} has unknown role {role!r}")
    lines = [model_identity, f"Knowledge cutoff: {knowledge_cutoff}"]
    if conversation_start_date is not None:
        lines.append(f"Current date: {conversation_start_date}")
    channels = "# Valid channels: analysis, commentary, final. Channel must be included for every message."
    if fn_tools:
        channels += "\nCalls to these tools must go to the commentary channel: 'functions'."
    system_parts = ["\n".join(lines), f"Reasoning: {reasoning_effort}"]
    if builtin_tools:
        unknown = sorted(set(builtin_tools) - set(BUILTIN_TOOLS))
        if unknown:
            raise HarmonyFormatError(f"builtin_tools {unknown} are not among {BUILTIN_TOOLS}")
        sections = ["\n".join([f"## {name}\n", *rust_lines(desc)]) for name, desc in builtin_tools.items()]
        system_parts.append("\n\n".join(["# Tools", *sections]))
    system = "\n\n".join([*system_parts, channels])
    out = [HarmonyMessage("system", system)]
    sections = []
    if instructions:
        sections += ["# Instructions", "\n\n".join(instructions)]
    if fn_tools:
        sections.append(tools_section(fn_tools))
    if sections:
        out.append(HarmonyMessage("developer", "\n\n".join(sections)))
    return out + body


def _assistant(msg: Mapping, call_names: dict[str, str]) -> list[HarmonyMessage]:
    out = []
    recipient = msg.get("recipient")
    channel = msg.get("channel") or ("commentary" if recipient else "final")
    if channel not in CHANNELS:
        raise HarmonyFormatError(f"assistant channel must be one of {CHANNELS}, got {channel!r}")
    content = _text(msg.get("content"))
    calls = msg.get("tool_calls") or []
    if recipient:
        content_type = msg.get("content_type", JSON_CONTENT_TYPE)
        out.append(HarmonyMessage("assistant", content, channel, _full_name(recipient), content_type))
    elif content or not calls:
        out.append(HarmonyMessage("assistant", content, channel, None, msg.get("content_type")))
    for call in calls:
        fn = call.get("function", call)
        name = _full_name(fn["name"])
        if call.get("id") is not None:
            call_names[str(call["id"])] = name
        out.append(
            HarmonyMessage(
                "assistant", _arguments(fn.get("arguments", "")), "commentary", name, JSON_CONTENT_TYPE
            )
        )
    return out


def drop_earlier_analysis(messages: Sequence[HarmonyMessage]) -> list[HarmonyMessage]:
    """openai-harmony's `auto_drop_analysis`: if the last assistant message is `final`, leave out the
    analysis messages before the first `final` message."""
    last = next((m for m in reversed(messages) if m.is_assistant), None)
    first_final = next((i for i, m in enumerate(messages) if m.channel == "final"), None)
    if last is None or last.channel != "final" or first_final is None:
        return list(messages)
    return [m for i, m in enumerate(messages) if not (i < first_final and m.channel == "analysis")]


def _check_placement(recipient_placement: str) -> None:
    if recipient_placement not in RECIPIENT_PLACEMENTS:
        raise HarmonyFormatError(
            f"recipient_placement must be one of {RECIPIENT_PLACEMENTS}, got {recipient_placement!r}"
        )


def render_message(
    message: HarmonyMessage, recipient_placement: str = DEFAULT_RECIPIENT_PLACEMENT
) -> list[int]:
    """The tokens of one message, `<|start|>` to its `<|end|>` (`<|call|>` for an assistant message with
    a recipient)."""
    _check_placement(recipient_placement)
    enc = get_tokenizer().encode
    ids = [START, *enc(message.author)]
    to = message.recipient is not None and message.recipient != "all"
    in_header = recipient_placement == "header" or message.channel != "commentary"
    if to and in_header:
        ids += enc(f" to={message.recipient}")
    if message.channel is not None:
        ids += [CHANNEL, *enc(message.channel)]
        if to and not in_header:
            ids += enc(f" to={message.recipient}")
    if message.content_type is not None:
        if message.content_type.startswith(CONSTRAIN_TEXT):
            ids += [*enc(" "), CONSTRAIN, *enc(message.content_type[len(CONSTRAIN_TEXT) :])]
        elif recipient_placement == "channel":  # oss-harmony marks every content type as constrained
            ids += [*enc(" "), CONSTRAIN, *enc(message.content_type)]
        else:
            ids += enc(f" {message.content_type}")
    ids += [MESSAGE, *enc(message.content)]
    ids.append(CALL if message.is_assistant and message.recipient is not None else END)
    return ids


def render_conversation(
    messages: Sequence[Mapping],
    *,
    reasoning_effort: str = "medium",
    tools: Sequence[Mapping] | None = None,
    conversation_start_date: str | None = None,
    recipient_placement: str = DEFAULT_RECIPIENT_PLACEMENT,
    drop_analysis: bool = True,
    builtin_tools: Mapping[str, str] | None = None,
) -> RenderedConversation:
    """The token stream of a conversation whose last turn is trained, as a model produces it.

    The trained turn is every message after the last system / developer / user message: assistant
    messages (analysis, commentary, tool calls, final) and the tool results between them. The stream is
    `render_prompt(messages before the turn)` (earlier turns' analysis dropped as the reference drops it)
    followed by the turn's messages as the model and its tools wrote them (the turn's analysis kept); a
    turn ending in a final answer ends in `<|return|>`, the token the model samples.

    `assistant_mask` is True exactly on the sampled tokens: each assistant message's tokens after the
    `<|start|>assistant` that precedes the turn or a tool result (those come from the prompt or the
    agentic loop), through its `<|end|>` / `<|call|>` / `<|return|>`; a later message's own
    `<|start|>assistant` (after `<|end|>`) is sampled too. Tool results are False.

    openai-harmony's `render_conversation_for_training` gives the same tokens for a turn without
    analysis; with analysis it drops the trained turn's own analysis (its rule: analysis before the first
    final message), which this function keeps."""
    last_context = max(
        (i for i, m in enumerate(messages) if m.get("role") not in ("assistant", "tool")), default=-1
    )
    context, turn = list(messages[: last_context + 1]), list(messages[last_context + 1 :])
    keywords: dict[str, Any] = dict(
        reasoning_effort=reasoning_effort,
        tools=tools,
        conversation_start_date=conversation_start_date,
        builtin_tools=builtin_tools,
    )
    prompt = render_prompt(
        context, recipient_placement=recipient_placement, drop_analysis=drop_analysis, **keywords
    )
    if not turn:
        ids = prompt[: -len(assistant_start())]
        return RenderedConversation(ids, [False] * len(ids), len(ids))
    hm = to_harmony_messages(turn, **keywords)
    hm = hm[next(i for i, m in enumerate(hm) if m.author not in ("system", "developer")) :]
    if not hm[0].is_assistant:
        raise HarmonyFormatError("a trained turn starts with an assistant message, not a tool result")
    n_start = len(assistant_start())
    ids, mask = prompt[:-n_start], [False] * (len(prompt) - n_start)
    prev_assistant = False
    for m in hm:
        toks = render_message(m, recipient_placement)
        given = 0 if not m.is_assistant else (0 if prev_assistant else n_start)
        mask += [False] * given + [m.is_assistant] * (len(toks) - given)
        ids += toks
        prev_assistant = m.is_assistant
    if hm[-1].is_assistant and hm[-1].channel == "final":
        ids[-1] = RETURN
    return RenderedConversation(ids, mask, len(prompt))


def render_prompt(
    messages: Sequence[Mapping],
    *,
    reasoning_effort: str = "medium",
    tools: Sequence[Mapping] | None = None,
    conversation_start_date: str | None = None,
    recipient_placement: str = DEFAULT_RECIPIENT_PLACEMENT,
    drop_analysis: bool = True,
    builtin_tools: Mapping[str, str] | None = None,
) -> list[int]:
    """The prompt for the assistant's next turn: the conversation, then `<|start|>assistant`; equal to
    openai-harmony's `render_conversation_for_completion(conversation, Role.ASSISTANT)`.
    `builtin_tools` ({"python": description}) lists built-in tools in the system message."""
    hm = to_harmony_messages(
        messages,
        reasoning_effort=reasoning_effort,
        tools=tools,
        conversation_start_date=conversation_start_date,
        builtin_tools=builtin_tools,
    )
    if drop_analysis:
        hm = drop_earlier_analysis(hm)
    ids: list[int] = []
    for m in hm:
        ids += render_message(m, recipient_placement)
    return ids + assistant_start()


def assistant_start() -> list[int]:
    """`<|start|>assistant`: what a prompt ends with, and what follows a tool result in an agentic loop."""
    return [START, *get_tokenizer().encode("assistant")]


def render_tool_result(
    name: str,
    content: str,
    *,
    channel: str = "commentary",
    recipient_placement: str = DEFAULT_RECIPIENT_PLACEMENT,
) -> list[int]:
    """The tokens of a tool's answer to the assistant (`name` as `functions.lookup`, `lookup`, or the
    built-in `python`) on `channel` (the channel of the call), as the agentic loop appends them after a
    `<|call|>`; follow them with `assistant_start()`."""
    if channel not in CHANNELS:
        raise HarmonyFormatError(f"tool result channel must be one of {CHANNELS}, got {channel!r}")
    return render_message(
        HarmonyMessage(_full_name(name), content, channel, "assistant"), recipient_placement
    )
