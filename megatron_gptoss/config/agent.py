"""Configuration of the agentic loop's tools (`agent`) and of the sandbox that runs model-written code
(`sandbox`)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from megatron_gptoss.errors import ConfigError

BUILTIN_TOOLS = ("python", "calculator")
_USER_FUNCTION = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")
_TOOL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_TOOL_KEYS = {"name", "function", "description", "parameters"}
# The SandboxConfig fields that are limits (each at least 1), in the order the launcher receives them.
SANDBOX_LIMITS = (
    "memory_bytes",
    "output_bytes",
    "cpu_s",
    "processes",
    "file_bytes",
    "disk_bytes",
    "open_files",
)


@dataclass
class SandboxConfig:
    """Limits of one sandboxed run of model-written Python (`megatron_gptoss.agent.run_python`)."""

    # Bytes of memory: the address space of each sandboxed process (RLIMIT_AS; a larger allocation fails)
    # and the resident memory of all its processes plus its tmpfs together (polled; past it the sandbox is
    # stopped).
    memory_bytes: int = 2 << 30
    # Bytes of stdout + stderr kept; past it the sandbox is stopped and the result marked truncated.
    output_bytes: int = 1 << 20
    # CPU seconds of each sandboxed process (RLIMIT_CPU; killed past it). The wall-time limit is the
    # call's timeout.
    cpu_s: int = 10
    # Processes and threads one sandbox may hold at once (RLIMIT_NPROC, counted per sandbox).
    processes: int = 32
    # Largest file the code may write (RLIMIT_FSIZE), on its tmpfs, the only place it may.
    file_bytes: int = 64 << 20
    # Bytes of the sandbox's tmpfs (its home, /tmp and /dev/shm; unlinked open files and deep trees count);
    # a write past it fails, and a sandbox that filled it is stopped. Counted in memory_bytes too.
    disk_bytes: int = 256 << 20
    # Open files per sandboxed process (RLIMIT_NOFILE).
    open_files: int = 256
    # Directory holding the sandboxes' temporary directories, each the mount point of its tmpfs (which
    # lives in the sandbox's own mount namespace: nothing is written below it); "": the system's.
    temp_root: str = ""
    # Run tools on a kernel whose Landlock ABI is below linux_sandbox.MIN_LANDLOCK_ABI (6, Linux 6.12),
    # with a warning: the protections it lacks rest on the mount namespace, the uid and seccomp alone.
    # False: such a kernel is refused, the missing protections named.
    allow_weak_kernel: bool = False
    # First of the host uids given to running sandboxes when the trainer runs as root (each sandbox runs
    # as a uid of its own: no root to regain, and RLIMIT_NPROC counted per sandbox); about 4M uids above it
    # are used. A trainer that is not root runs sandboxes as itself, in a user namespace.
    uid_base: int = 1_500_000_000

    def validate(self) -> None:
        for name in SANDBOX_LIMITS:
            if getattr(self, name) < 1:
                raise ConfigError(f"sandbox.{name} must be >= 1, got {getattr(self, name)}")
        if self.memory_bytes < 64 << 20:
            raise ConfigError(f"sandbox.memory_bytes={self.memory_bytes} is too small for an interpreter")
        if self.disk_bytes < 1 << 20:
            raise ConfigError(
                f"sandbox.disk_bytes={self.disk_bytes} is too small: the sandbox's tmpfs holds its code "
                "too (at least 1 MiB)"
            )
        if self.processes < 2:
            raise ConfigError(
                f"sandbox.processes must be >= 2 (the interpreter and one), got {self.processes}"
            )
        if not 1000 <= self.uid_base <= (1 << 32) - (1 << 23):
            raise ConfigError(f"sandbox.uid_base={self.uid_base} must be in [1000, 2**32 - 2**23]")


@dataclass
class AgentConfig:
    """The tools an agentic rollout offers the model, and the budgets of one trajectory."""

    # Agentic rollouts: the trainer's rollouts (and its evaluation) are multi-turn trajectories that call
    # the tools below; tool tokens are out of the loss. Needs harmony prompts (env.name: dataset).
    enabled: bool = False
    # Keep each trajectory's KV cache across turns through the engine's sessions, where the engine layout
    # allows it (the embedded engine, one rank per replica); false: every turn re-generates from the whole
    # trajectory (what vLLM does, served by its prefix cache).
    sessions: bool = True
    # Without sessions: each round of re-generation waits for every pending tool call, so the rows of a
    # round and their seeds do not depend on how fast tools answer (a seeded run is reproducible on any
    # layout); a slow call then delays the round. False: rows whose calls have not answered wait for a
    # later round while the others generate.
    wait_for_tools: bool = False
    # Built-in tools offered: "python" (model-written code in the sandbox; harmony's built-in `python`
    # recipient) and "calculator" (arithmetic, a function tool).
    builtin_tools: list[str] = field(default_factory=lambda: ["python", "calculator"])
    # User function tools, each a mapping {name, function: "module:function", description, parameters:
    # a JSON schema of the arguments}; the function takes the arguments as keywords and returns a string
    # or a JSON-serialisable value.
    tools: list[Any] = field(default_factory=list)
    # Assistant turns (model generations) of one trajectory at most; a call in the last turn is not run (no
    # turn is left to read its result): the trajectory ends with finish reason "max_turns".
    max_turns: int = 8
    # Tokens of one trajectory (prompt, model and tool tokens) at most.
    max_total_tokens: int = 8192
    # Seconds one tool call may take (wall time); past it the call ends as a timeout for the model.
    tool_timeout_s: float = 10.0
    # Tool calls running at once across every trajectory of a batch.
    max_concurrent_calls: int = 8
    # Characters of one tool result shown to the model; a longer result is cut and says so.
    max_result_chars: int = 4096

    def validate(self) -> None:
        for name in self.builtin_tools:
            if name not in BUILTIN_TOOLS:
                raise ConfigError(f"agent.builtin_tools: {name!r} is not one of {BUILTIN_TOOLS}")
        names = set(self.builtin_tools)
        for i, tool in enumerate(self.tools):
            _validate_tool(i, tool, names)
        for name in ("max_turns", "max_total_tokens", "max_concurrent_calls", "max_result_chars"):
            if getattr(self, name) < 1:
                raise ConfigError(f"agent.{name} must be >= 1, got {getattr(self, name)}")
        if not self.tool_timeout_s > 0:
            raise ConfigError(f"agent.tool_timeout_s must be > 0, got {self.tool_timeout_s}")


def _validate_tool(i: int, tool: Any, names: set[str]) -> None:
    where = f"agent.tools[{i}]"
    if not isinstance(tool, Mapping):
        raise ConfigError(f"{where} must be a mapping with name, function, parameters; got {tool!r}")
    unknown = sorted(set(tool) - _TOOL_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown keys {unknown}; known: {sorted(_TOOL_KEYS)}")
    name = tool.get("name")
    if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
        raise ConfigError(f"{where}.name={name!r} must be an identifier")
    if name in names:
        raise ConfigError(f"{where}.name={name!r} is already a tool's name")
    names.add(name)
    function = tool.get("function")
    if not isinstance(function, str) or not _USER_FUNCTION.fullmatch(function):
        raise ConfigError(f"{where}.function={function!r} must be 'module:function'")
    if not isinstance(tool.get("description", ""), str):
        raise ConfigError(f"{where}.description must be a string")
    params = tool.get("parameters")
    if params is not None and (not isinstance(params, Mapping) or params.get("type") != "object"):
        raise ConfigError(f"{where}.parameters must be a JSON schema of type 'object', got {params!r}")
