"""The docs stand on their own: every link in docs/ and README.md that is not a web address
points at a file inside this repository that exists (a user's clone holds nothing else), and
no page sends readers to a path outside it (``../shared/...``, an absolute path)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
#: A path written in backticks that climbs out of docs/ and then out of the repository, or an
#: absolute path on the machine the docs were written on.
OUTSIDE = re.compile(r"`(\.\./\.\./[^`]*|\.\./shared/[^`]*|/work/[^`]*|/home/[^`]*)`")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_stays_inside_the_repository(page):
    text = page.read_text(encoding="utf-8")
    broken = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a web address (https:, mailto:) or an anchor on the page
        path = (page.parent / target.split("#", 1)[0]).resolve()
        if not path.is_relative_to(ROOT):
            broken.append(f"{target} leaves the repository")
        elif not path.exists():
            broken.append(f"{target} does not exist")
    broken += [f"`{m}` points outside the repository" for m in OUTSIDE.findall(text)]
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"
