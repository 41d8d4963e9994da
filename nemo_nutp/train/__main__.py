"""``python -m nemo_nutp.train``: same as ``nutp-train``."""

import sys

from ..launch.train import main

sys.exit(main())
