"""The reference renderer for tests/harmony: whichever `openai_harmony` module is installed (oss-harmony
0.0.11 under tools/install.sh), reading the o200k_base vocabulary written offline from quicktok's."""

import pytest
from helpers.harmony_encoding import load_reference


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """(openai_harmony module, its HarmonyEncoding, its recipient placement: "header" or "channel")."""
    oh, enc = load_reference(tmp_path_factory.mktemp("tiktoken"))
    probe = oh.Message.from_role_and_content(oh.Role.ASSISTANT, "{}")
    text = enc.decode_utf8(enc.render(probe.with_channel("commentary").with_recipient("functions.f")))
    placement = "header" if text.index(" to=") < text.index("<|channel|>") else "channel"
    return oh, enc, placement
