"""Errors that fedhier reports to users as one clear line (exit code 2)."""


class FedhierError(Exception):
    """Base class: a problem the user can fix; the CLI prints it as one line."""


class ConfigError(FedhierError):
    """An invalid or inconsistent run configuration."""


class DataError(FedhierError):
    """A dataset that cannot be found, read or partitioned as asked."""
