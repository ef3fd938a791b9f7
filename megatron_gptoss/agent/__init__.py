"""The tool layer of agentic rollouts: a sandbox for model-written Python, the tools, and the harmony
plumbing that turns a tool call the model wrote into the tokens of its result.

Public API:

    Sandbox (megatron_gptoss.agent.sandbox)
      run_python(code, *, timeout_s, limits=None, launcher=None) -> PythonResult   (never raises for
          anything the code does; ToolError only when the sandbox cannot run on this machine)
          PythonResult(stdout, stderr, exit_code: int | None, timed_out, truncated, out_of_memory,
                       out_of_disk, wall_s, error: str | None)   error: a failure outside the code's control
      start_launcher(uid_base=...) -> SandboxLauncher   start the sandbox launcher now (before CUDA)
      SandboxLauncher(uid_base, python, read_paths=None, landlock_abi=None)
          read_paths: host paths bound read-only into every sandbox (default: the interpreter's
          installation and the system libraries); landlock_abi: a cap below the kernel's (an older kernel)
      SandboxLauncher.layers: {layer: None if it works here, else why not}
      SandboxLauncher.check(limits): ToolError for a missing layer or a Landlock ABI below the minimum
          (unless limits.allow_weak_kernel)

    Tools (megatron_gptoss.agent.tools)
      Tool(name, description, parameters, run)   name is the recipient: "python", "functions.NAME"
      ToolRegistry.from_config(agent_cfg, sandbox_cfg, launcher=None)
      ToolRegistry.prompt_keywords() -> {"tools", "builtin_tools"}   keywords of harmony.render_prompt
      calculator.evaluate(expression) -> int | float   (CalculatorError for anything not arithmetic)

    Calls (megatron_gptoss.agent.calls)
      parse_tool_call(completion_ids) -> ToolCall(recipient, channel, content_type, arguments) | None
      check_call(registry, call, budget_left=...) -> (tool, arguments) | ToolOutcome (an error for the model)
      run_call(registry, call, timeout_s=..., budget_left=..., max_chars=...) -> ToolOutcome(text, status,
          latency_s); status "ok" | "error" | "timeout"; raises only ToolError (the sandbox cannot run)
      tool_result_tokens(trajectory, call, outcome) -> ids to append after the model's <|call|>: the tool
          message and <|start|>assistant (all tool tokens, out of the loss)

    Executor (megatron_gptoss.agent.executor)
      ToolExecutor(registry, timeout_s=, max_concurrent=, max_chars=), ToolExecutor.from_config(registry, cfg)
      .submit(call, budget_left=True) -> Future[ToolOutcome]; .run(call) -> ToolOutcome
      .metrics(reset=True) -> ToolMetrics(calls, ok, errors, timeouts, abandoned, peak_running, latencies);
          ToolMetrics.summary() -> {"tool/calls": ..., "tool/latency_mean_s": ...}

    Loop (megatron_gptoss.agent.loop)
      AgentLoop(engine, executor, params, agent_cfg, call_format=HARMONY, use_sessions=None)
      .rollout(prompts) -> [Trajectory(prompt_ids, token_ids, sources (MODEL=1 / TOOL=0), logprobs (0.0 on
          tool tokens), finish_reason, turns, tool_calls, tool_errors, tool_timeouts, routing (per turn))]
          engines with sessions keep each trajectory's KV cache; others re-generate from the trajectory
      Trajectory.generation() -> AgentGeneration (a Generation; routing [len - 1, layers, k] or None)
      agent_metrics(trajectories, rewards=None) -> {"agent/turns_mean": ..., "agent/tokens_tool": ...}
"""

from megatron_gptoss.agent.calls import (
    ToolCall,
    ToolOutcome,
    check_call,
    parse_tool_call,
    run_call,
    tool_result_tokens,
)
from megatron_gptoss.agent.executor import ToolExecutor, ToolMetrics
from megatron_gptoss.agent.loop import MODEL, TOOL, AgentLoop, CallFormat, Trajectory, agent_metrics
from megatron_gptoss.agent.sandbox import PythonResult, SandboxLauncher, run_python, start_launcher
from megatron_gptoss.agent.tools import Tool, ToolRegistry

__all__ = [
    "MODEL",
    "TOOL",
    "AgentLoop",
    "CallFormat",
    "Trajectory",
    "agent_metrics",
    "PythonResult",
    "SandboxLauncher",
    "Tool",
    "ToolCall",
    "ToolExecutor",
    "ToolMetrics",
    "ToolOutcome",
    "ToolRegistry",
    "check_call",
    "parse_tool_call",
    "run_call",
    "run_python",
    "start_launcher",
    "tool_result_tokens",
]
