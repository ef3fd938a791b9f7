"""The tools a model may call: the built-in `python` (harmony's built-in recipient, over `run_python`),
a calculator, and user function tools from `agent.tools` (`module:function` with a JSON schema).

Function tools are described to the model in the developer message as harmony's `functions` namespace;
the python tool in the system message. `ToolRegistry.prompt_keywords()` gives `render_prompt` both.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from megatron_gptoss.agent import calculator
from megatron_gptoss.agent.sandbox import PythonResult, SandboxLauncher, run_python
from megatron_gptoss.config.agent import AgentConfig, SandboxConfig
from megatron_gptoss.errors import ConfigError

PYTHON = "python"
PYTHON_DESCRIPTION = (
    "Use this tool to execute Python code in your chain of thought. The code will not be shown to the "
    "user.\n\nWhen you send a message containing Python code to python, it is run as a fresh program in "
    "a sandbox: nothing is kept between calls, there is no network, and files can be written only in the "
    "working directory. python responds with what the program printed (stdout, then stderr) or times out "
    "after {timeout:g} seconds. Print what you want to see."
)


class ToolTimeout(Exception):
    """Raised by a tool's `run` that stopped at its timeout; the message is what the model reads."""


@dataclass(frozen=True)
class Tool:
    """One tool. `name` is the recipient the model writes (`python`, `functions.lookup`); `run` takes the
    parsed arguments (a dict for a function tool, the code for python) and the timeout in seconds and
    returns the text the model reads."""

    name: str
    description: str
    parameters: Mapping[str, Any] | None
    run: Callable[[Any, float], str]

    @property
    def builtin(self) -> bool:
        return not self.name.startswith("functions.")


def python_tool(limits: SandboxConfig, launcher: SandboxLauncher | None, timeout_s: float) -> Tool:
    def run(code: str, timeout: float) -> str:
        result = run_python(code, timeout_s=timeout, limits=limits, launcher=launcher)
        if result.timed_out:
            raise ToolTimeout(python_output(result))
        return python_output(result)

    return Tool(PYTHON, PYTHON_DESCRIPTION.format(timeout=timeout_s), None, run)


def python_output(result: PythonResult) -> str:
    """What the model reads of a sandboxed run: stdout, then stderr, then how it ended if not cleanly."""
    text = result.stdout + result.stderr
    if result.timed_out:
        text += "\n[timed out]"
    elif result.truncated:
        text += "\n[output truncated]"
    elif result.out_of_memory:
        text += "\n[stopped: out of memory]"
    elif result.out_of_disk:
        text += "\n[stopped: out of disk space]"
    elif result.exit_code is not None and result.exit_code < 0:
        text += f"\n[killed by signal {-result.exit_code}]"
    return text


def calculator_tool() -> Tool:
    def run(arguments: dict, timeout: float) -> str:
        return calculator.calculator(arguments["expression"])

    return Tool("functions.calculator", calculator.DESCRIPTION, calculator.PARAMETERS, run)


def resolve_function(spec: str, where: str) -> Callable[..., Any]:
    """The callable named by `module:function`; ConfigError naming `where` when it cannot be imported."""
    module_name, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"{where}={spec!r} cannot be imported: {err}") from None
    if not callable(fn):
        raise ConfigError(f"{where}={spec!r} is not callable")
    return fn


def user_tool(spec: Mapping[str, Any], where: str) -> Tool:
    """A function tool from an `agent.tools` entry; its function gets the arguments as keywords and
    returns a string (as is) or a JSON-serialisable value (as JSON)."""
    fn = resolve_function(spec["function"], f"{where}.function")

    def run(arguments: dict, timeout: float) -> str:
        value = fn(**arguments)
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)

    return Tool(f"functions.{spec['name']}", spec.get("description", ""), spec.get("parameters"), run)


class ToolRegistry:
    """The tools of a rollout, by recipient name."""

    def __init__(self, tools: Sequence[Tool]):
        self.tools: dict[str, Tool] = {}
        for tool in tools:
            if tool.name in self.tools:
                raise ConfigError(f"two tools are named {tool.name!r}")
            self.tools[tool.name] = tool

    @classmethod
    def from_config(
        cls, agent: AgentConfig, sandbox: SandboxConfig, launcher: SandboxLauncher | None = None
    ) -> ToolRegistry:
        tools = []
        if "python" in agent.builtin_tools:
            tools.append(python_tool(sandbox, launcher, agent.tool_timeout_s))
        if "calculator" in agent.builtin_tools:
            tools.append(calculator_tool())
        tools += [user_tool(spec, f"agent.tools[{i}]") for i, spec in enumerate(agent.tools)]
        return cls(tools)

    def get(self, recipient: str | None) -> Tool | None:
        return self.tools.get(recipient or "")

    def prompt_keywords(self) -> dict[str, Any]:
        """`tools` (function tools, OpenAI format) and `builtin_tools` for harmony's `render_prompt`."""
        functions = [
            {
                "type": "function",
                "function": {
                    "name": t.name.removeprefix("functions."),
                    "description": t.description,
                    **({"parameters": dict(t.parameters)} if t.parameters is not None else {}),
                },
            }
            for t in self.tools.values()
            if not t.builtin
        ]
        builtin = {t.name: t.description for t in self.tools.values() if t.builtin}
        return {"tools": functions or None, "builtin_tools": builtin or None}
