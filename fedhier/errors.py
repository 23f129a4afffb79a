"""Errors that fedhier reports to users as one clear line (exit code 2)."""


class FedhierError(Exception):
    """Base class: a problem the user can fix; the CLI prints it as one line."""


class ConfigError(FedhierError):
    """An invalid or inconsistent run configuration."""


class DataError(FedhierError):
    """A dataset that cannot be found, read or partitioned as asked."""


class DamagedFileError(ConfigError, DataError):
    """A file fedhier reads (a data file, a checkpoint, a run folder's file, a TOML file) that
    is damaged, unreadable or not what its name says: one line naming the file, what is wrong
    and what to do (exit code 2). Every reader raises this one type; it is both a ConfigError
    and a DataError, so code catching the kind of file's earlier error keeps working."""

    def __init__(self, path: object, reason: str, remedy: str = "") -> None:
        self.path = str(path)
        self.reason = " ".join(str(reason).split())
        self.remedy = remedy
        super().__init__(f"{self.path}: {self.reason}{'; ' + remedy if remedy else ''}")


def os_reason(exc: BaseException) -> str:
    """The short reason of an exception from reading a file (an OSError's strerror)."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    text = " ".join(str(exc).split())[:200]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
