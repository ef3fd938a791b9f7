"""Build a `TrainConfig` from a YAML file of overrides and `section.field=value` command-line pairs.

Every value is checked against its dataclass field's type while loading, and every section's ranges by
`TrainConfig.validate`, so a bad config fails with one `ConfigError` naming the field (or the file and
line, or the override) before anything is built."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from megatron_gptoss.config.agent import AgentConfig, SandboxConfig
from megatron_gptoss.config.algorithm import AlgorithmConfig
from megatron_gptoss.config.critic import CriticConfig
from megatron_gptoss.config.dapo import DAPOConfig
from megatron_gptoss.config.data import DataConfig
from megatron_gptoss.config.engine import EmbeddedEngineConfig
from megatron_gptoss.config.model import MODEL_PRESETS
from megatron_gptoss.config.moe import MoEReplayConfig
from megatron_gptoss.config.reward import RewardConfig
from megatron_gptoss.config.train import (
    EnvConfig,
    OptimConfig,
    ParallelConfig,
    PPOConfig,
    RolloutConfig,
    RunConfig,
    SFTConfig,
    TrainConfig,
)
from megatron_gptoss.errors import ConfigError

SECTION_TYPES = {
    "parallel": ParallelConfig,
    "optim": OptimConfig,
    "ppo": PPOConfig,
    "algorithm": AlgorithmConfig,
    "dapo": DAPOConfig,
    "critic": CriticConfig,
    "moe": MoEReplayConfig,
    "rollout": RolloutConfig,
    "embedded": EmbeddedEngineConfig,
    "env": EnvConfig,
    "data": DataConfig,
    "sft": SFTConfig,
    "reward": RewardConfig,
    "agent": AgentConfig,
    "sandbox": SandboxConfig,
    "run": RunConfig,
}


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Defaults <- YAML file <- `a.b=value` overrides; the YAML may name `model.preset` (MODEL_PRESETS).
    Raises ConfigError naming the file (and line) for a missing, unreadable, empty or malformed file, the
    override for a malformed override, and the field for a value of the wrong type or range."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = _read_yaml(Path(path))
        if raw is None:
            raise ConfigError(
                f"{path} is empty: a config file names at least the model (model: {{preset: ...}}); an empty "
                "one would silently mean every default (gpt-oss-20b)"
            )
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections")
    for item in overrides or []:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ConfigError(f"override {item!r} must look like section.field=value")
        key, value = item.split("=", 1)
        *sections, name = key.split(".")
        target = raw
        for depth, part in enumerate(sections):  # `model.lora.rank=8` sets a field of a nested section
            if target.get(part) is None:
                target[part] = {}
            if not isinstance(target[part], dict):
                where = ".".join(sections[: depth + 1])
                raise ConfigError(f"override {item!r}: section {where!r} of the file is not a mapping")
            target = target[part]
        try:
            target[name] = yaml.safe_load(value)
        except yaml.YAMLError as err:
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({_problem(err)})") from None
    return build_config(raw)


def _read_yaml(path: Path) -> Any:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise ConfigError(f"cannot read config file {path}: {reason}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        raise ConfigError(f"{where}: invalid YAML ({_problem(err)})") from None


def _problem(err: yaml.YAMLError) -> str:
    """The reason of a YAML error without its multi-line excerpt of the file."""
    parts = [getattr(err, "context", None), getattr(err, "problem", None)]
    return ", ".join(p for p in parts if p) or str(err).splitlines()[0]


def build_config(raw: dict[str, Any]) -> TrainConfig:
    sections = {f.name: f for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(map(str, set(raw) - set(sections)))
    if unknown:
        raise ConfigError(f"unknown config sections {unknown}; known: {sorted(sections)}")
    model_raw = _section("model", raw.get("model"))
    preset = model_raw.pop("preset", "gpt_oss_20b")
    if not isinstance(preset, str) or preset not in MODEL_PRESETS:
        raise ConfigError(f"model.preset={preset!r} not in {sorted(MODEL_PRESETS)}")
    model_cls = MODEL_PRESETS[preset]().__class__
    _check_fields("model", model_cls, model_raw)
    parts: dict[str, Any] = {"model": MODEL_PRESETS[preset](**model_raw)}
    for name in sections:
        if name == "model":
            continue
        cls = SECTION_TYPES[name]
        values = _section(name, raw.get(name))
        _check_fields(name, cls, values)
        parts[name] = cls(**values)
    cfg = TrainConfig(**parts)
    cfg.validate()
    return cfg


def _section(name: str, values: Any) -> dict[str, Any]:
    """A copy of the mapping of one section (an empty or absent section is empty)."""
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(f"section {name!r} must be a mapping of fields, got {values!r}")
    return dict(values)


def _check_fields(section: str, cls: Any, values: dict[str, Any]) -> None:
    """Reject unknown fields and values of the wrong type, naming `section.field`, the expected type and
    the value; convert in place what YAML leaves as strings: numbers (`1e-3`) where the field is a float,
    comma-separated items (`5,6`) where it is a list."""
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(map(str, set(values) - fields))
    if unknown:
        raise ConfigError(f"unknown fields in section {section!r}: {unknown}")
    for name, value in values.items():
        values[name] = _convert(f"{section}.{name}", hints[name], value)


def _convert(key: str, hint: Any, value: Any) -> Any:
    """`value` as the type `hint` (int, float, bool, str, list[...] / tuple[..., ...], X | None, or a
    nested config dataclass given as a mapping of its fields, checked the same way)."""
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        if isinstance(value, hint):
            return value
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping of fields, got {value!r}")
        values = dict(value)
        _check_fields(key, hint, values)
        return hint(**values)
    converted = _as(hint, value)
    if converted is _INVALID:
        raise ConfigError(f"{key}={value!r}: expected {_describe(hint)}, got {type(value).__name__}")
    return converted


_INVALID = object()


def _as(hint: Any, value: Any) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is not type(None) and (converted := _as(arg, value)) is not _INVALID:
                return converted
        return _INVALID
    if origin in (list, tuple):
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            items = [items]
        item_hint = args[0] if args else Any
        converted_items = [_as(item_hint, item.strip() if isinstance(item, str) else item) for item in items]
        if any(item is _INVALID for item in converted_items):
            return _INVALID
        return origin(converted_items)
    if hint is Any:
        return value
    if hint is bool:
        return value if isinstance(value, bool) else _INVALID
    if hint is int:
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                return _INVALID
        return value if isinstance(value, int) and not isinstance(value, bool) else _INVALID
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            return _INVALID
        try:
            number = float(value)
        except ValueError:
            return _INVALID
        return number if math.isfinite(number) else _INVALID
    if hint is str:
        return value if isinstance(value, str) else _INVALID
    raise TypeError(f"config fields of type {hint!r} are not supported by the loader")


def _describe(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if arg is type(None) else _describe(arg) for arg in args)
    if origin in (list, tuple):
        item = _describe(args[0]) if args else "value"
        return f"a list of {item.removeprefix('an ').removeprefix('a ')}s"
    return {int: "an integer", float: "a finite number", bool: "true or false", str: "a string"}.get(
        hint, str(hint)
    )


def config_to_dict(cfg: TrainConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
