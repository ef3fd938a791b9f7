"""The metrics loggers a run may name in `run.loggers`, and the optional packages they need.

    jsonl        output_dir/metrics.jsonl, always written (plots, tools and resume read it)
    tensorboard  output_dir/tensorboard (torch.utils.tensorboard; part of the base install)
    wandb        Weights & Biases (extra `wandb`)
    mlflow       MLflow (extra `mlflow`)

A logger whose packages are missing is a ConfigError of one line naming the extra to install, raised when
the config is validated (before anything is built) and again by the logger itself if the package went away.
"""

from __future__ import annotations

import importlib.util

from megatron_gptoss.errors import ConfigError

LOGGERS = ("jsonl", "tensorboard", "wandb", "mlflow")
# Logger -> (extra of setup.py that installs it, the modules it imports).
EXTRAS: dict[str, tuple[str, tuple[str, ...]]] = {
    "wandb": ("wandb", ("wandb",)),
    "mlflow": ("mlflow", ("mlflow", "sqlalchemy", "alembic")),
}


def missing_package_message(logger: str, module: str) -> str:
    """The one-line error for logger `logger` (a key of EXTRAS) when `module` cannot be imported."""
    extra = EXTRAS[logger][0]
    return (
        f"run.loggers lists {logger!r}, but the package {module!r} is not installed: install the "
        f"extra with pip install 'megatron_gptoss[{extra}]' (from a checkout: pip install -e '.[{extra}]')"
    )


def check_loggers(loggers: list[str]) -> None:
    """ConfigError naming `run.loggers` for a name outside LOGGERS, a name listed twice, or a logger whose
    packages are not installed (found without importing them)."""
    unknown = [name for name in loggers if name not in LOGGERS]
    if unknown:
        raise ConfigError(f"run.loggers={loggers!r}: unknown logger(s) {unknown}; known: {list(LOGGERS)}")
    repeated = sorted({name for name in loggers if loggers.count(name) > 1})
    if repeated:
        raise ConfigError(f"run.loggers={loggers!r} lists {repeated} more than once")
    for name in loggers:
        for module in EXTRAS.get(name, ("", ()))[1]:
            if importlib.util.find_spec(module) is None:
                raise ConfigError(missing_package_message(name, module))
