"""fedhier: hierarchical federated learning (clients -> edge servers -> cloud) on Flower."""

from pathlib import Path as _Path

# Installed, the top-level folders strategies/, clients/ and datasets_cfg/ are the
# subpackages fedhier.strategies, fedhier.clients and fedhier.datasets_cfg (pyproject.toml maps
# them). Run from a source tree without that mapping (the FAB that `flwr run .` builds and
# unpacks, or a checkout on sys.path), find them next to this folder instead.
_here = _Path(__file__).resolve().parent
_source_tree = (_here.parent / "strategies" / "server_app.py").is_file()
if _source_tree and not (_here / "strategies").is_dir():
    __path__.append(str(_here.parent))
del _here, _source_tree
