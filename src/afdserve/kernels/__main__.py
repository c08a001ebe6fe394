"""``python -m afdserve.kernels``: builds (or finds) the kernels of this machine and says which."""

import sys

from afdserve.kernels.build import main

sys.exit(main())
