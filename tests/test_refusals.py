"""Every refusal is declared where it is raised, refused as declared, and in the docs.

Each part that cannot run a combination lists it in its module's ``REFUSALS``
(:class:`fedhier.common.errors.Refusal`); :mod:`fedhier.settings.refusals` gathers them and
generates docs/hsgd.md's table. Here: the docs hold today's table, every declaration's example
exits 2 from ``fedhier run`` with one line that holds the declared words and writes no run
folder, and the gathering sees every module that declares refusals.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from fedhier.cli.commands import main
from fedhier.common.errors import Refusal
from fedhier.settings.refusals import OWNERS, declared, table, with_table

ROOT = Path(__file__).resolve().parents[1]
DECLARED = declared()


def test_the_docs_hold_the_generated_table():
    text = (ROOT / "docs" / "hsgd.md").read_text(encoding="utf-8")
    assert with_table(text) == text, (
        "docs/hsgd.md's refusals table is stale: python -m fedhier.settings.refusals "
        "--write-docs docs/hsgd.md")
    assert table().count("\n") == len(DECLARED) + 1


@pytest.mark.parametrize(("owner", "refusal"), DECLARED,
                         ids=[f"{o.rsplit('.', 1)[-1]}:{r.what[:40]}" for o, r in DECLARED])
def test_each_declared_example_is_refused_as_declared(owner, refusal, tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["run", *refusal.example, "--out", str(out), "--no-progress"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2, f"{refusal.example} ran (exit {code}); {owner} declares it refused"
    assert len(lines) == 1 and refusal.says in lines[0], lines
    assert not out.exists()


def test_every_module_that_declares_refusals_is_gathered():
    """A module under fedhier/ that defines REFUSALS is one of OWNERS (else its refusals
    would be missing from the docs)."""
    declaring = set()
    for path in (ROOT / "fedhier").rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if any(isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "REFUSALS" for t in node.targets)
               for node in tree.body):
            declaring.add(".".join(path.relative_to(ROOT).with_suffix("").parts))
    assert declaring == set(OWNERS)


def test_a_refusal_says_whether_it_has_a_meaning():
    with pytest.raises(ValueError, match="no meaning"):
        Refusal("x", "because", ("--rounds", "1"), "x")
    assert repr(Refusal("x", "not yet: soon", (), "x")) == "Refusal('x')"
