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


class Refusal:
    """A combination of settings a part cannot run, declared beside the code that refuses it.

    Each owner module lists its refusals in ``REFUSALS``; docs/hsgd.md's table of refusals is
    generated from them (:mod:`fedhier.settings.refusals`), and a test runs every ``example``
    through ``fedhier run`` and expects exit 2 with one line holding ``says``.

    Args:
        what: the combination, as the table shows it (Markdown);
        why: ``"no meaning: ..."`` (a combination without one) or ``"not yet: ..."`` (one
            still to be built; ``"not yet on real processes: ..."`` and the like);
        example: ``fedhier run`` arguments that meet it;
        says: a part of the one-line error the refusal prints.
    """

    def __init__(self, what: str, why: str, example: tuple[str, ...], says: str) -> None:
        if not why.startswith(("no meaning: ", "not yet")):
            raise ValueError(f"a refusal's why starts 'no meaning: ' or 'not yet': {why!r}")
        self.what, self.why, self.example, self.says = what, why, example, says

    def __repr__(self) -> str:
        return f"Refusal({self.what!r})"
