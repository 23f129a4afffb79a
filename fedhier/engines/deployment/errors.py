"""The errors of a deployment: failures of processes or of the run, not bad input."""

from __future__ import annotations


class DeployError(RuntimeError):
    """The federation could not be started or the run failed (not a bad-input error)."""


class DeployTimeoutError(DeployError):
    """The run did not finish within ``--timeout`` seconds."""
