"""Fixtures of tests/agent: the installed openai_harmony as reference (vocabulary written offline), and one
sandbox launcher for the module."""

import pytest
from helpers.harmony_encoding import load_reference

from megatron_gptoss.agent import SandboxLauncher


@pytest.fixture(scope="session")
def harmony_reference(tmp_path_factory):
    """(openai_harmony module, its HarmonyEncoding)."""
    oh, enc = load_reference(tmp_path_factory.mktemp("tiktoken"))
    return oh, enc


@pytest.fixture(scope="module")
def sandbox_launcher():
    launcher = SandboxLauncher()
    yield launcher
    launcher.close()
