"""Errors that fedhier reports to users as one clear line (exit code 2)."""

import unicodedata


def one_line(text: str) -> str:
    """``text`` with control and line-separator characters escaped (a value a user typed,
    such as ``grouping = "\\n"``, must not break an error into two lines or drive the
    terminal): newline -> \\n, ESC -> \\x1b, U+2028 -> \\u2028."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() or ch == " " else
                   repr(ch)[1:-1] if unicodedata.category(ch) == "Cc" else
                   f"\\u{ord(ch):04x}" for ch in text)


class FedhierError(Exception):
    """Base class: a problem the user can fix; the CLI prints it as one line."""


class ConfigError(FedhierError):
    """An invalid or inconsistent run configuration (its message kept on one line)."""

    def __init__(self, message: object = "", *args: object) -> None:
        super().__init__(one_line(str(message)), *args)


class DataError(FedhierError):
    """A dataset that cannot be found, read or partitioned as asked."""
