"""Execution engines: how a run is executed (never what it computes).

The names and run functions are in :mod:`fedhier.engines.registry`; the Deployment Engine
(``fedhier deploy``) is in :mod:`fedhier.engines.deployment`. This package imports nothing on
its own, so ``import fedhier.engines.registry`` stays free of torch and Flower.
"""
