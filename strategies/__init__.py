"""Flower ServerApp side of fedhier: hierarchical strategies built on flwr.serverapp.strategy."""

from fedhier.strategies.hierfedavg import Communication, HierFedAvg

__all__ = ["Communication", "HierFedAvg"]
