"""The tool layer of agentic rollouts: a sandbox for model-written Python, the tools, and the harmony
plumbing that turns a tool call the model wrote into the tokens of its result.

Public API:

    Sandbox (megatron_gptoss.agent.sandbox)
      run_python(code, *, timeout_s, limits=None, launcher=None) -> PythonResult
          PythonResult(stdout, stderr, exit_code: int | None, timed_out, truncated, wall_s)
      start_launcher(uid_base=...) -> SandboxLauncher   start the sandbox launcher now (before CUDA)
      SandboxLauncher.layers: {layer: None if it works here, else why not}
"""

from megatron_gptoss.agent.sandbox import PythonResult, SandboxLauncher, run_python, start_launcher

__all__ = ["PythonResult", "SandboxLauncher", "run_python", "start_launcher"]
