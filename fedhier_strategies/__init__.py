"""Flower ServerApp side of fedhier: hierarchical strategies built on flwr.serverapp.strategy."""

from fedhier.communication import Communication
from fedhier_strategies.hierfedavg import HierFedAvg

__all__ = ["Communication", "HierFedAvg"]
