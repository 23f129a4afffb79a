"""fedhier: hierarchical federated learning (clients -> edge servers -> cloud) on Flower.

The core (no Flower outside :mod:`fedhier.engines`), with Flower's ServerApp and ClientApp
side as ``fedhier.strategies`` and ``fedhier.clients`` and the dataset cards as
``fedhier.datasets_cfg``: in the repository (and the FAB of ``flwr run .``) these three are the
root folders ``strategies/``, ``clients/`` and ``datasets_cfg/``; installed they sit inside
this package (:mod:`fedhier.common.import_names`, docs/install.md). docs/index.md draws the
layers and parts.
"""

from pathlib import Path as _Path

from fedhier.common.import_names import install as _install

_install(_Path(__file__).resolve().parent)
