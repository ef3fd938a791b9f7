"""The calculator against Python's own arithmetic on random expressions, its refusals, and the agent
config's validation."""

import math
import random

import pytest

from megatron_gptoss.agent.calculator import CalculatorError, evaluate
from megatron_gptoss.config import AgentConfig, SandboxConfig, load_config
from megatron_gptoss.errors import ConfigError


def _random_expression(rng, depth=0):
    if depth > 3 or rng.random() < 0.3:
        return str(rng.randint(0, 99)) if rng.random() < 0.7 else f"{rng.uniform(0, 50):.3f}"
    op = rng.choice(["+", "-", "*", "/", "//", "%", "**"])
    left, right = _random_expression(rng, depth + 1), _random_expression(rng, depth + 1)
    if op == "**":
        right = str(rng.randint(0, 4))
    return f"({left} {op} {right})" if rng.random() < 0.5 else f"-({left}) {op} {right}"


def test_calculator_equals_python_arithmetic():
    rng = random.Random(0)
    checked = 0
    for _ in range(400):
        text = _random_expression(rng)
        try:
            expected = eval(text, {"__builtins__": {}})  # the reference: trusted, generated here
        except ArithmeticError:
            with pytest.raises(CalculatorError):
                evaluate(text)
            continue
        got = evaluate(text)
        assert type(got) is type(expected), text
        assert got == expected or (math.isnan(got) and math.isnan(expected)), text
        checked += 1
    assert checked > 300
    assert evaluate("sqrt(16) + max(2, 3) * pi") == 4.0 + 3 * math.pi
    assert evaluate("2 ** 100") == 1267650600228229401496703205376  # integers stay exact


@pytest.mark.parametrize(
    "text, message",
    [
        ("__import__('os').system('true')", "unknown function"),
        ("().__class__", "not arithmetic"),
        ("x + 1", "unknown name 'x'"),
        ("9 ** 9 ** 9", "exponent"),
        ("10 ** 5000", "exceeds"),
        ("'a' * 3", "not arithmetic"),
        ("(lambda: 1)()", "unknown function"),
        ("1 +", "not an arithmetic expression"),
        ("1 / 0", "ZeroDivisionError"),
        ("exp(1000)", "OverflowError"),
    ],
)
def test_calculator_refuses(text, message):
    with pytest.raises(CalculatorError, match=message):
        evaluate(text)


def test_agent_config_validation_names_the_field():
    bad = [
        (AgentConfig(builtin_tools=["shell"]), "agent.builtin_tools"),
        (AgentConfig(tools=[{"name": "f", "function": "nomodule"}]), r"agent.tools\[0\].function"),
        (AgentConfig(tools=[{"name": "python", "function": "m:f"}]), r"agent.tools\[0\].name='python'"),
        (
            AgentConfig(tools=[{"name": "f", "function": "m:f", "parameters": {"type": "string"}}]),
            "parameters",
        ),
        (AgentConfig(tools=[{"name": "f", "function": "m:f", "color": 1}]), "unknown keys"),
        (AgentConfig(max_turns=0), "agent.max_turns"),
        (AgentConfig(tool_timeout_s=0), "agent.tool_timeout_s"),
    ]
    for cfg, message in bad:
        with pytest.raises(ConfigError, match=message):
            cfg.validate()
    with pytest.raises(ConfigError, match="sandbox.processes"):
        SandboxConfig(processes=1).validate()
    with pytest.raises(ConfigError, match="sandbox.memory_bytes"):
        SandboxConfig(memory_bytes=1 << 20).validate()


def test_agent_sections_load_from_yaml(tmp_path):
    path = tmp_path / "agent.yaml"
    path.write_text(
        "agent:\n  max_turns: 3\n  tools:\n    - name: lookup\n      function: helpers_tools:lookup\n"
        "      parameters: {type: object, properties: {key: {type: string}}}\n"
        "sandbox:\n  memory_bytes: 1073741824\n"
    )
    cfg = load_config(path, ["agent.tool_timeout_s=2.5"])
    assert cfg.agent.max_turns == 3 and cfg.agent.tool_timeout_s == 2.5
    assert cfg.agent.tools[0]["function"] == "helpers_tools:lookup"
    assert cfg.sandbox.memory_bytes == 1 << 30
    with pytest.raises(ConfigError, match="agent.max_turns"):
        load_config(path, ["agent.max_turns=0"])
