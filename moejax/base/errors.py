"""Errors a user can cause. The CLI prints their message as one line and exits with 2."""

from moejax.config import ConfigError


class UsageError(ConfigError):
    """Bad arguments or input data (token ids, files, device counts)."""
