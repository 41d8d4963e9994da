"""Silence megatron-core's import-time notes about optional fused kernels.

megatron-core warns, once per module, that Transformer Engine / Apex are not installed and that it
falls back to its local implementations (8 lines on every start, before anything of ours; on CPU
they cannot be installed at all). They say nothing a user can act on here, so the entry points
drop them, in this process and in the ranks it starts (``PYTHONWARNINGS`` is inherited). Every
other warning still shows.
"""

from __future__ import annotations

import os
import warnings

NOTES = ("Transformer Engine and Apex are not installed",
         "Apex is not installed",
         "The pynvml package is deprecated",
         "full scope is deprecated")  # megatron-core 0.16's own TransformerConfig default
"""Message prefixes (``warnings`` matches a filter's message at the start, case-insensitively)."""


def filter_notes() -> None:
    """This process only (run when ``nemo_nutp`` is imported: ``python -m nemo_nutp.train``
    imports the training package, and megatron with it, before its ``__main__``)."""
    for note in NOTES:
        warnings.filterwarnings("ignore", message=note)


def quiet_optional_kernel_notes() -> None:
    """This process and the processes it starts (entry points)."""
    filter_notes()
    inherited = [w for w in os.environ.get("PYTHONWARNINGS", "").split(",") if w]
    mine = [f"ignore:{note}" for note in NOTES if f"ignore:{note}" not in inherited]
    os.environ["PYTHONWARNINGS"] = ",".join(inherited + mine)
