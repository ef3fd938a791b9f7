"""The error raised for an invalid configuration."""


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the numbers."""
