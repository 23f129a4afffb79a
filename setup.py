"""Package discovery for setuptools (all other metadata is in pyproject.toml).

The top-level folders strategies/, clients/ and datasets_cfg/ are installed as the
subpackages fedhier.strategies, fedhier.clients and fedhier.datasets_cfg
([tool.setuptools.package-dir] in pyproject.toml). `find_packages` picks up every package
below fedhier/ and below those folders, so a new subpackage is never left out of the wheel.
"""

from setuptools import find_packages, setup

MAPPED = {"fedhier.strategies": "strategies", "fedhier.clients": "clients",
          "fedhier.datasets_cfg": "datasets_cfg"}

packages = find_packages(include=["fedhier", "fedhier.*"])
for name, folder in MAPPED.items():
    packages += [name, *(f"{name}.{sub}" for sub in find_packages(folder))]

setup(packages=sorted(packages))
