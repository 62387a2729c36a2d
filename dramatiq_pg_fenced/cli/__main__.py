"""``python -m dramatiq_pg_fenced.cli``."""

import sys

from .command import main

sys.exit(main())
