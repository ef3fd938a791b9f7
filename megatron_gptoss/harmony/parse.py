"""Parse what the model generated after the prompt's `<|start|>assistant` into messages, never raising.

The first message's header starts right away (its role is `assistant`); every later message starts with
`<|start|>` and its author. A header holds the channel after `<|channel|>`, the recipient as `to=NAME`
(in the header after the author, or after the channel: both placements parse the same) and a content
type (`<|constrain|>json`, or a bare word such as `json`). A message's content runs to `<|end|>`,
`<|return|>` or `<|call|>`; other special tokens inside content are read as their spelling, as
openai-harmony's parser reads them. Header rules follow openai-harmony's `parse_header_from_string`.

An agentic trajectory (`agent.AgentLoop`: model turns and tool results in one stream) parses whole: after a
`<|call|>`, a `<|start|>` goes on with the tool's message (author `functions.NAME` or `python`) and the
turns after it, so a reward reads the trajectory's final answer.
"""

from __future__ import annotations

from collections.abc import Iterable

from megatron_gptoss.harmony.tokenizer import CALL, END, MESSAGE, RETURN, START, VOCAB_SIZE, get_tokenizer

ROLES = ("system", "developer", "user", "assistant", "tool")
_ENDS = {END: "end", RETURN: "return", CALL: "call"}
_CHANNEL_TEXT = "<|channel|>"
_CONSTRAIN_TEXT = "<|constrain|>"


class ParsedCompletion(list):
    """The parsed messages (a list of dicts) and why parsing stopped early, if it did.

    Each message is `{"role", "name", "channel", "recipient", "content_type", "content", "end"}`: `role`
    is `assistant` (or `tool`, `user`, ... if the model wrote such a message; `name` is a tool author's
    name, else None), `channel` / `recipient` / `content_type` are None when absent (`recipient` e.g.
    `functions.lookup`, `content_type` e.g. `<|constrain|>json`), `content` is the raw text and `end` the
    token that closed the message: `"end"`, `"return"`, `"call"`, or None when the tokens ran out first.

    `error` is None for a well-formed completion: messages, the last one closed by `<|return|>` or
    `<|call|>`, nothing after it (after a `<|call|>`, further messages starting with `<|start|>` belong to
    it). Otherwise it names the first problem (truncation, an id outside the vocabulary, a malformed
    header, tokens after the end); the messages read before it are kept, and a message cut short is kept
    with `end` None."""

    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def _header(text: str, first: bool) -> tuple[dict, str | None]:
    """(fields, error) of a header's text (everything between `<|start|>` and `<|message|>`)."""
    channel = None
    idx = text.find(_CHANNEL_TEXT)
    if idx >= 0:
        after = text[idx + len(_CHANNEL_TEXT) :]
        stop = next((j for j, c in enumerate(after) if c.isspace() or c == "<"), len(after))
        if stop == 0:
            return {}, "empty channel after <|channel|>"
        channel = after[:stop]
        text = text[:idx] + after[stop:]
    text = text.strip()
    if _CONSTRAIN_TEXT in text:
        text = text.replace(_CONSTRAIN_TEXT, " " + _CONSTRAIN_TEXT).strip()
    parts = text.split()
    role, name = "assistant", None
    if not first:
        if not parts:
            return {}, "message header has no author"
        if parts[0] in ROLES:
            role = parts[0]
        elif len(parts) > 1 or parts[0].startswith("to="):
            role, name = "tool", parts.pop(0)
        else:
            return {}, f"unknown author {parts[0]!r}"
    if parts and parts[0] == role:
        parts.pop(0)
    recipient = content_type = None
    if parts:
        last = parts.pop()
        if last.startswith("to="):
            recipient = last[3:]
        elif not parts:
            recipient = last
        else:
            content_type = last
            raw = parts.pop()
            recipient = raw[3:] if raw.startswith("to=") else raw
    if parts:
        return {}, f"unexpected text in message header: {' '.join(parts)!r}"
    fields = {
        "role": role,
        "name": name,
        "channel": channel,
        "recipient": recipient,
        "content_type": content_type,
    }
    return fields, None


def parse_completion(token_ids: Iterable[int]) -> ParsedCompletion:
    """The messages of a completion (the tokens after the prompt's `<|start|>assistant`); see
    ParsedCompletion. Never raises: anything malformed ends parsing with `error` set."""
    out = ParsedCompletion()
    try:
        ids = [int(t) for t in token_ids]
    except (TypeError, ValueError) as e:
        out.error = f"token ids are not integers: {e}"
        return out
    tok = get_tokenizer()
    bad = next((i for i, t in enumerate(ids) if not 0 <= t < VOCAB_SIZE), None)
    if bad is not None:
        out.error = f"token id {ids[bad]} at position {bad} is outside the vocabulary"
        ids = ids[:bad]
    pos, first = 0, True
    while pos < len(ids):
        if not first:
            if ids[pos] != START:
                got = tok.decode([ids[pos]])
                out.error = out.error or f"expected <|start|> at position {pos}, got {got!r}"
                return out
            pos += 1
        try:
            msg_at = ids.index(MESSAGE, pos)
        except ValueError:
            out.error = out.error or f"truncated in a message header (from position {pos})"
            return out
        head = ids[pos:msg_at]
        stray = next((t for t in head if t in _ENDS or t == START), None)
        if stray is not None:
            out.error = out.error or f"{tok.decode([stray])} inside a message header (from position {pos})"
            return out
        fields, err = _header(tok.decode(head), first)
        if err is not None:
            out.error = out.error or f"{err} (header from position {pos})"
            return out
        first = False
        end_at = next((j for j in range(msg_at + 1, len(ids)) if ids[j] in _ENDS), None)
        content = tok.decode(ids[msg_at + 1 : end_at])
        end = _ENDS[ids[end_at]] if end_at is not None else None
        out.append({**fields, "content": content, "end": end})
        if end_at is None:
            out.error = out.error or "truncated in a message's content (no <|end|>, <|return|> or <|call|>)"
            return out
        pos = end_at + 1
        continues = end == "call" and pos < len(ids) and ids[pos] == START  # a tool's result follows
        if end in ("return", "call") and not continues:
            if pos < len(ids):
                out.error = out.error or f"{len(ids) - pos} tokens after <|{end}|>"
            return out
    if not out:
        out.error = out.error or "empty completion"
    elif out.error is None:
        out.error = "truncated after <|end|>: no <|return|> or <|call|>"
    return out
