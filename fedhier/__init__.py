"""fedhier: hierarchical federated learning (clients -> edge servers -> cloud) on Flower.

This package is the core (no Flower outside :mod:`fedhier.engines`); Flower's ServerApp and
ClientApp side are the sibling packages ``fedhier_strategies`` and ``fedhier_clients``.
"""
