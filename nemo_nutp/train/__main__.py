"""``python -m nemo_nutp.train``: same as ``nutp-train``."""

import sys

from ..launch.nutp_train import main

sys.exit(main())
