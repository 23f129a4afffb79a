"""``python -m fedhier.engines.deployment local --nodes N ...`` = ``fedhier deploy local``."""

import sys

from fedhier.engines.deployment.cli import main

sys.exit(main())
