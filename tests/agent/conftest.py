"""Fixtures of tests/agent: the installed openai_harmony as reference (vocabulary written offline), and one
sandbox launcher for the module."""

import os

import pytest

from megatron_gptoss.agent import SandboxLauncher
from megatron_gptoss.harmony import write_tiktoken_base


@pytest.fixture(scope="session")
def harmony_reference(tmp_path_factory):
    """(openai_harmony module, its HarmonyEncoding)."""
    directory = write_tiktoken_base(tmp_path_factory.mktemp("tiktoken")).parent
    old = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(directory)
    try:
        import openai_harmony as oh

        enc = oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)
    finally:
        if old is None:
            os.environ.pop("TIKTOKEN_ENCODINGS_BASE", None)
        else:
            os.environ["TIKTOKEN_ENCODINGS_BASE"] = old
    return oh, enc


@pytest.fixture(scope="module")
def sandbox_launcher():
    launcher = SandboxLauncher()
    yield launcher
    launcher.close()
