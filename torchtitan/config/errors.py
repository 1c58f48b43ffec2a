"""The config error type. A leaf: it imports nothing from torchtitan, so any layer can raise it."""


class ConfigError(ValueError):
    """A user-facing config problem; the message says what, where, what is allowed and how to fix it."""
