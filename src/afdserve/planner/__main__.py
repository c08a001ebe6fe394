"""``python -m afdserve.planner [plan] ...`` -- the ``afdserve plan`` command, standalone."""

import sys

from afdserve.planner.cli import main

sys.exit(main())
