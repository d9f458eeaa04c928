"""The one error a bad setting raises, at the bottom of the config package (its modules import each other upward
only: errors <- validate, io <- fields <- cli)."""


class ConfigError(ValueError):
    """A bad setting. The message names the field and the fix."""
