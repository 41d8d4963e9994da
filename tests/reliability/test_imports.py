"""Processes that never train (the Slurm control process, node agents, the job aggregator) start
without torch or megatron-core: at 1K+ nodes an agent that imports megatron (~6 CPU-s, 30 s
on a loaded node) delays every world start and every replacement process."""

from __future__ import annotations

import subprocess
import sys

LIGHT = ("nemo_nutp.recovery.agent", "nemo_nutp.launch.control",
         "nemo_nutp.health.aggregate", "nemo_nutp.recovery.control",
         "nemo_nutp.health.watch", "nemo_nutp.common.events")


def test_control_side_modules_import_without_torch_or_megatron() -> None:
    code = ("import sys\n" + "".join(f"import {m}\n" for m in LIGHT)
            + "print(sorted(m for m in ('torch', 'megatron.core') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=300).stdout.strip()
    assert out == "[]", f"heavy modules imported by {LIGHT}: {out}"
