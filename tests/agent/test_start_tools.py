"""The trainer's tool start-up (`trainer.agentic.start_tools`): a kernel whose Landlock ABI is below the
minimum (simulated) is refused when the run starts, before any step, naming the missing protections; with
`sandbox.allow_weak_kernel` the launcher is returned."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_gptoss.agent import SandboxLauncher
from megatron_gptoss.config import load_config
from megatron_gptoss.errors import ToolError
from megatron_gptoss.trainer import agentic


@pytest.fixture
def weak_launcher(monkeypatch):
    launchers: list[SandboxLauncher] = []

    def start(uid_base):
        launchers.append(SandboxLauncher(uid_base, landlock_abi=5))
        return launchers[-1]

    monkeypatch.setattr(agentic, "start_launcher", start)
    yield launchers
    for launcher in launchers:
        launcher.close()


def test_weak_kernel_refused_at_start(weak_launcher):
    cfg = load_config("configs/demo_cpu.yaml", ["agent.enabled=true", "agent.builtin_tools=[python]"])
    with pytest.raises(ToolError, match=r"Landlock ABI is 5, below 6: missing .*allow_weak_kernel"):
        agentic.start_tools(cfg)
    allowed = dataclasses.replace(cfg, sandbox=dataclasses.replace(cfg.sandbox, allow_weak_kernel=True))
    assert agentic.start_tools(allowed) is weak_launcher[-1]
