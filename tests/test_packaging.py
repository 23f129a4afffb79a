"""pyproject.toml installs every package folder: a wheel (not only an editable install) has
every module."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_installed():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {name: ROOT / path for name, path in setuptools["package-dir"].items()}
    found = set()
    for package, folder in folders.items():
        for init in folder.rglob("__init__.py"):
            found.add(".".join((package, *init.parent.relative_to(folder).parts)))
    assert found - set(setuptools["packages"]) == set()
