"""``python -m afdserve.backends.cpu``: builds (once per machine) and loads the CPU kernels, and says
which run here."""

import sys

from afdserve.backends.cpu.build import main

sys.exit(main())
