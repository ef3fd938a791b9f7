"""The installed `openai_harmony` module (the reference renderer of tests/harmony and tests/agent) with its
gpt-oss encoding, reading the o200k_base vocabulary written offline from quicktok's."""

from __future__ import annotations

import os
from pathlib import Path

from megatron_gptoss.harmony import write_tiktoken_base


def load_reference(directory: Path):
    """(openai_harmony module, its HarmonyEncoding), the vocabulary file written into `directory`."""
    base = write_tiktoken_base(directory).parent
    old = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(base)
    try:
        import openai_harmony as oh

        enc = oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)
    finally:
        if old is None:
            os.environ.pop("TIKTOKEN_ENCODINGS_BASE", None)
        else:
            os.environ["TIKTOKEN_ENCODINGS_BASE"] = old
    return oh, enc
