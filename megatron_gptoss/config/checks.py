"""Range checks shared by the config sections: one ConfigError naming `section.field` and its value."""

from __future__ import annotations

from megatron_gptoss.errors import ConfigError

DTYPES = ("float32", "bfloat16")


def check_at_least(section: str, part: object, minimum: float, *names: str) -> None:
    """ConfigError naming `section.name` and its value when a field of `part` is below `minimum`."""
    for name in names:
        if getattr(part, name) < minimum:
            raise ConfigError(f"{section}.{name} must be >= {minimum}, got {getattr(part, name)}")


def check_positive(section: str, part: object, *names: str) -> None:
    """ConfigError naming `section.name` and its value when a field of `part` is not > 0."""
    for name in names:
        if not getattr(part, name) > 0:
            raise ConfigError(f"{section}.{name} must be > 0, got {getattr(part, name)}")
