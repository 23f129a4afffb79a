"""``python -m fedhier.cli ...`` = ``fedhier ...``."""

import sys

from fedhier.cli.commands import main

sys.exit(main())
