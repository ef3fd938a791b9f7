"""Verifiable tasks: prompts, a held-out evaluation set and a verifier that turns a response into a reward."""

from __future__ import annotations

from megatron_gptoss.agent.tools import ToolRegistry
from megatron_gptoss.config.agent import AgentConfig, SandboxConfig
from megatron_gptoss.config.data import DataConfig
from megatron_gptoss.config.reward import RewardConfig
from megatron_gptoss.config.train import EnvConfig
from megatron_gptoss.envs.arithmetic import ArithmeticTask, Prompt
from megatron_gptoss.envs.dataset import DatasetTask
from megatron_gptoss.envs.digits import DigitPrompt, DigitTask
from megatron_gptoss.envs.tokenizer import CharTokenizer
from megatron_gptoss.errors import ConfigError
from megatron_gptoss.harmony.tokenizer import HarmonyTokenizer

TASKS = {"arithmetic": ArithmeticTask, "dataset": DatasetTask, "reverse": DigitTask, "sort": DigitTask}


def make_task(
    cfg: EnvConfig,
    data: DataConfig | None = None,
    reward: RewardConfig | None = None,
    agent: AgentConfig | None = None,
) -> tuple[ArithmeticTask | DigitTask | DatasetTask, CharTokenizer | HarmonyTokenizer]:
    """The task named by `cfg.name` and its tokenizer: "arithmetic", "reverse" or "sort" (character tokens;
    `envs.arithmetic`, `envs.digits`) or "dataset" (prompt files in harmony's format, scored by `reward`).
    With `agent` (agentic rollouts), the dataset's prompts describe its tools to the model. Raises
    ConfigError for an unknown name, or tools on a task without harmony prompts."""
    if cfg.name in ("arithmetic", "reverse", "sort"):
        if agent is not None:
            raise ConfigError(f"agent.enabled needs harmony prompts (env.name='dataset'), not {cfg.name!r}")
        tokenizer = CharTokenizer()
        task_class = ArithmeticTask if cfg.name == "arithmetic" else DigitTask
        return task_class(cfg, tokenizer), tokenizer
    if cfg.name == "dataset":
        tools = None
        if agent is not None:  # descriptions only: the tools that run are the trainer's
            tools = ToolRegistry.from_config(agent, SandboxConfig()).prompt_keywords()
        task = DatasetTask(data or DataConfig(), reward or RewardConfig(), cfg.eval_size, tools)
        return task, task.tokenizer
    raise ConfigError(f"env.name={cfg.name!r} not in {sorted(TASKS)}")


__all__ = [
    "TASKS",
    "ArithmeticTask",
    "CharTokenizer",
    "DatasetTask",
    "DigitPrompt",
    "DigitTask",
    "Prompt",
    "make_task",
]
