"""The one error type for bad launch flags; the CLI turns it into a message and exit code 2."""


class ConfigError(ValueError):
    """A launch flag is unknown, malformed, out of range, or not supported here."""
