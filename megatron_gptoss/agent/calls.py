"""From the tokens of a tool call the model wrote to the tokens of the tool's answer.

    model tokens ... <|call|> ──parse_tool_call──> ToolCall(recipient, channel, arguments)
        ──check_call──> a Tool and its arguments, or an error message for the model (never an exception)
        ──run_call / ToolExecutor──> ToolOutcome(text, status)
        ──tool_result_tokens──> <|start|>{tool} ... <|message|>{text}<|end|><|start|>assistant

A tool call ends with the `<|call|>` the model sampled, and harmony renders a completed tool call in a
conversation with that same `<|call|>` (only a final answer's `<|return|>` becomes `<|end|>` when a
conversation is rendered again, and a trajectory ends there). So the stream is extended, never rewritten:
the trajectory so far, then the tool message, then `<|start|>assistant`. For a call written as harmony
renders it, that stream is exactly the renderer's `render_prompt` of the conversation with the tool result
(tests compare it with openai-harmony's `render_conversation_for_completion`), and the mask of its
sampled tokens is `render_conversation`'s: every appended token is a tool token, out of the loss.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megatron_gptoss.agent.arguments import check_arguments
from megatron_gptoss.agent.tools import Tool, ToolFailed, ToolRegistry, ToolTimeout
from megatron_gptoss.errors import ToolError
from megatron_gptoss.harmony import (
    CALL,
    CHANNELS,
    DEFAULT_RECIPIENT_PLACEMENT,
    assistant_start,
    parse_completion,
    render_tool_result,
)

STATUSES = ("ok", "error", "timeout")
TRUNCATION_MARK = "\n[... {n} characters cut]"
MAX_ARGUMENT_DEPTH = 64  # arrays and objects nested in a function tool's arguments at most
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_JSON_BRACKET = re.compile(r"[\[\]{}]")


@dataclass(frozen=True)
class ToolCall:
    """A tool call as the model wrote it: `recipient` (`python`, `functions.lookup`, or whatever the model
    named), the `channel` it was written on (the answer comes back on it), its content type and raw
    `arguments` (JSON for function tools, code for python)."""

    recipient: str
    channel: str
    content_type: str | None
    arguments: str


@dataclass(frozen=True)
class ToolOutcome:
    """What the model reads back (`text`) and how the call went: `status` "ok", "error" (a malformed
    call, an unknown tool, arguments against the schema, a call past the budget, or the tool raised) or
    "timeout"; `latency_s` of the call."""

    text: str
    status: str
    latency_s: float = 0.0


def parse_tool_call(completion: Sequence[int]) -> ToolCall | None:
    """The tool call a generation ended with (the tokens after `<|start|>assistant`, ending in
    `<|call|>`), or None when it ended otherwise or its last message names no recipient (the trajectory
    cannot be answered and ends). Both recipient placements parse. A call on a channel harmony does not
    have (a model's typo) is answered on `commentary`."""
    if not completion or completion[-1] != CALL:
        return None
    messages = parse_completion(completion)
    if not messages or messages[-1]["end"] != "call" or not messages[-1]["recipient"]:
        return None
    last = messages[-1]
    channel = last["channel"] if last["channel"] in CHANNELS else "commentary"
    return ToolCall(last["recipient"], channel, last["content_type"], last["content"])


def error(text: str) -> ToolOutcome:
    return ToolOutcome(f"error: {text}", "error")


def check_call(
    registry: ToolRegistry, call: ToolCall, *, budget_left: bool
) -> tuple[Tool, object] | ToolOutcome:
    """(the tool, its parsed arguments), or the error outcome the model reads instead."""
    if not budget_left:
        return error("the tool-call budget of this conversation is spent; give your final answer now")
    tool = registry.get(call.recipient)
    if tool is None:
        return error(f"unknown tool {call.recipient!r}; the tools are {sorted(registry.tools)}")
    if tool.name == "python":
        return tool, call.arguments
    depth = nesting_depth(call.arguments)
    if depth > MAX_ARGUMENT_DEPTH:
        return error(
            f"the arguments of {tool.name} nest {depth} arrays or objects deep; "
            f"at most {MAX_ARGUMENT_DEPTH} are accepted"
        )
    try:
        arguments = json.loads(call.arguments) if call.arguments.strip() else {}
    except json.JSONDecodeError as err:
        return error(f"the arguments of {tool.name} are not valid JSON: {err}")
    problem = check_arguments(tool.parameters, arguments)
    if problem is not None:
        return error(f"wrong arguments for {tool.name}: {problem}")
    return tool, arguments


def nesting_depth(text: str) -> int:
    """How deep JSON arrays and objects nest in `text` (brackets inside strings not counted), read without
    recursion: parsing or checking deeper arguments would exhaust the interpreter's stack."""
    depth = deepest = 0
    for bracket in _JSON_BRACKET.finditer(_JSON_STRING.sub("", text)):
        depth += 1 if bracket.group() in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def cut(text: str, max_chars: int) -> str:
    """`text` cut to `max_chars` characters, saying how much was cut."""
    if len(text) <= max_chars:
        return text
    return text[:max_chars] + TRUNCATION_MARK.format(n=len(text) - max_chars)


def run_call(
    registry: ToolRegistry,
    call: ToolCall,
    *,
    timeout_s: float,
    budget_left: bool,
    max_chars: int,
    started: Callable[[], None] | None = None,
) -> ToolOutcome:
    """Check and run one call in this thread. Whatever the model got wrong (arguments nested deeper than
    MAX_ARGUMENT_DEPTH included), and whatever the tool raised, becomes an error outcome; only ToolError
    (the sandbox or a tool worker cannot run: not the model's doing) propagates. A user tool's worker is
    killed at `timeout_s` (a timeout outcome); an in-process function tool is not interrupted here:
    ToolExecutor answers it at its timeout. `started()` is called when the tool begins to run (a user tool:
    once its worker is ready), where the call's timeout starts."""
    start = time.monotonic()
    checked = check_call(registry, call, budget_left=budget_left)
    if isinstance(checked, ToolOutcome):
        return ToolOutcome(checked.text, checked.status, time.monotonic() - start)
    tool, arguments = checked
    started = started or _nothing
    try:
        if tool.reports_start:
            text = tool.run(arguments, timeout_s, started)
        else:
            started()
            text = tool.run(arguments, timeout_s)
    except ToolError:
        raise
    except ToolTimeout as err:
        return ToolOutcome(cut(str(err), max_chars), "timeout", time.monotonic() - start)
    except ToolFailed as err:  # raised in a user tool's worker, or the worker died
        return ToolOutcome(
            cut(f"error: {tool.name} failed: {err}", max_chars), "error", time.monotonic() - start
        )
    except Exception as err:
        return ToolOutcome(
            f"error: {tool.name} failed: {type(err).__name__}: {err}", "error", time.monotonic() - start
        )
    return ToolOutcome(cut(text, max_chars), "ok", time.monotonic() - start)


def _nothing() -> None:
    pass


def tool_result_tokens(
    trajectory: Sequence[int],
    call: ToolCall,
    outcome: ToolOutcome,
    *,
    recipient_placement: str = DEFAULT_RECIPIENT_PLACEMENT,
) -> list[int]:
    """The token ids to append to `trajectory` (which ends with the model's `<|call|>`): the tool's
    message from `call.recipient` to the assistant on `call.channel`, then `<|start|>assistant` for the
    model's next turn. None of them is a model token."""
    if not trajectory or trajectory[-1] != CALL:
        raise ValueError("tool_result_tokens: the trajectory must end with the model's <|call|>")
    return [
        *render_tool_result(
            call.recipient, outcome.text, channel=call.channel, recipient_placement=recipient_placement
        ),
        *assistant_start(),
    ]
