"""GPT-OSS's harmony format: the o200k_harmony tokenizer (offline), chat rendering and completion parsing.

Public API (stable; other packages import only these names from `megatron_gptoss.harmony`):

    Tokenizer (megatron_gptoss.harmony.tokenizer)
      get_tokenizer() -> HarmonyTokenizer                  one cached instance
      HarmonyTokenizer.encode(text: str) -> list[int]      ordinary text only: "<|start|>" in a message
                                                           is never the special id
      HarmonyTokenizer.decode(ids, errors="replace") -> str, .decode_bytes(ids) -> bytes,
      .token_bytes(id) -> bytes, .is_special(id) -> bool, .special_id(text) -> int, .vocab_size == 201088
      VOCAB_SIZE = 201088; START 200006, END 200007, MESSAGE 200008, CHANNEL 200005, RETURN 200002,
      CALL 200012, CONSTRAIN 200003, ENDOFTEXT 199999
      write_tiktoken_base(directory) -> Path               o200k_base.tiktoken for openai_harmony (tests)

    Rendering (megatron_gptoss.harmony.render); messages are OpenAI-style dicts:
      {"role": "system" | "developer", "content"}          -> the developer message's instructions
      {"role": "user", "content"}
      {"role": "assistant", "content", "channel": "analysis" | "commentary" | "final" (default)}
      {"role": "assistant", "recipient": "functions.NAME", "content": "<json>"}   a tool call
          (or OpenAI "tool_calls": [{"id", "function": {"name", "arguments"}}])
      {"role": "tool", "name": "functions.NAME" (or "tool_call_id"), "content", "channel"}    a tool result
          ("channel" defaults to commentary; "name": "python" is the built-in python tool)
      tools: OpenAI chat-completions format [{"type": "function", "function": {"name", "description",
          "parameters"}}]
      render_prompt(messages, *, reasoning_effort="medium", tools=None, conversation_start_date=None,
                    recipient_placement="channel", drop_analysis=True, builtin_tools=None) -> list[int]
          builtin_tools: {"python": description}, listed in the system message
          ends with <|start|>assistant; == openai_harmony's render_conversation_for_completion
      render_conversation(messages, *, same keywords) -> RenderedConversation(token_ids, assistant_mask,
                                                                           num_prompt_tokens)
          for training: the last turn (the messages after the last system / developer / user message)
          as the model wrote it, after render_prompt(the messages before it); a final answer ends in
          <|return|>; assistant_mask[i] is True exactly on the tokens the model sampled (tool results,
          the prompt and the <|start|>assistant before the turn and after each tool result are False)
      render_tool_result(name, content, *, channel="commentary", recipient_placement="channel") -> list[int]
      CHANNELS = ("analysis", "commentary", "final")       the channels a message may name
      assistant_start() -> list[int]                       [<|start|>, "assistant"]
      stop_token_ids() -> list[int]                        [<|return|>, <|call|>]: a rollout stops there
      HarmonyFormatError(ValueError)                       a message that cannot be rendered

    Parsing (megatron_gptoss.harmony.parse)
      parse_completion(token_ids) -> ParsedCompletion      never raises
          ParsedCompletion is a list of {"role", "name", "channel", "recipient", "content_type",
          "content", "end"} dicts with .error (None when well-formed: the last message ends in
          <|return|> or <|call|>) and .ok; a tool call has channel "commentary", recipient
          "functions.NAME", content_type "<|constrain|>json", end "call". Both recipient placements
          parse. A multi-turn trajectory parses whole: a <|call|> followed by <|start|> goes on with
          the tool's message and the later turns.

`recipient_placement`: "channel" writes `<|channel|>commentary to=functions.NAME` (oss-harmony 0.0.11,
the reference the project installs; on other channels the recipient stays in the header, and content types
are written `<|constrain|>TYPE`), "header" writes `<|start|>assistant to=functions.NAME<|channel|>`
(openai-harmony 0.0.8). Nothing here imports openai_harmony; see README.md.
"""

from megatron_gptoss.harmony.parse import ParsedCompletion, parse_completion
from megatron_gptoss.harmony.render import (
    CHANNELS,
    DEFAULT_RECIPIENT_PLACEMENT,
    HarmonyFormatError,
    HarmonyMessage,
    RenderedConversation,
    assistant_start,
    render_conversation,
    render_prompt,
    render_tool_result,
    stop_token_ids,
)
from megatron_gptoss.harmony.tokenizer import (
    CALL,
    CHANNEL,
    CONSTRAIN,
    END,
    ENDOFTEXT,
    MESSAGE,
    RETURN,
    START,
    VOCAB_SIZE,
    HarmonyTokenizer,
    get_tokenizer,
    write_tiktoken_base,
)

__all__ = [
    "CALL",
    "CHANNEL",
    "CHANNELS",
    "CONSTRAIN",
    "DEFAULT_RECIPIENT_PLACEMENT",
    "END",
    "ENDOFTEXT",
    "MESSAGE",
    "RETURN",
    "START",
    "VOCAB_SIZE",
    "HarmonyFormatError",
    "HarmonyMessage",
    "HarmonyTokenizer",
    "ParsedCompletion",
    "RenderedConversation",
    "assistant_start",
    "get_tokenizer",
    "parse_completion",
    "render_conversation",
    "render_prompt",
    "render_tool_result",
    "stop_token_ids",
    "write_tiktoken_base",
]
