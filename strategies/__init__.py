"""Flower ServerApp side of fedhier: hierarchical strategies built on flwr.serverapp.strategy."""

from fedhier.round.traffic import Communication
from fedhier.strategies.hierfedavg import HierFedAvg

__all__ = ["Communication", "HierFedAvg"]
