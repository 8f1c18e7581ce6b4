"""The one error a configuration raises."""


class ConfigError(ValueError):
    """A configuration the user wrote that cannot run; the message is one line for the CLI."""
