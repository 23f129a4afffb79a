"""``fedhier_clients``, the last release's name of :mod:`fedhier.clients` (installed as its
own package for one release): warns once and forwards every submodule."""

import warnings

import fedhier  # noqa: F401  (puts the finder of the old names' submodules in place)

warnings.warn("fedhier_clients is renamed fedhier.clients; the old name goes in the next "
              "release", DeprecationWarning, stacklevel=2)
