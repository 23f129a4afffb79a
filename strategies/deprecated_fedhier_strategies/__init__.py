"""``fedhier_strategies``, the last release's name of :mod:`fedhier.strategies` (installed
as its own package for one release): warns once and forwards every name and submodule."""

import warnings

from fedhier.strategies import *  # noqa: F403
from fedhier.strategies import __all__  # noqa: F401

warnings.warn("fedhier_strategies is renamed fedhier.strategies; the old name goes in the "
              "next release", DeprecationWarning, stacklevel=2)
