"""Timestamped recovery events: one JSON object per line in ``$NUTP_EVENTS`` (if set).

Lines are short single ``write`` calls on an ``O_APPEND`` file, so ranks and the supervisor can
append concurrently. Without ``NUTP_EVENTS`` nothing is written.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from .env import EVENTS


def log_event(event: str, *, file: str | Path | None = None, **fields: Any
              ) -> dict[str, Any]:
    row = {"t": time.time(), "event": event, **fields}
    target = file or os.environ.get(EVENTS)
    if target:
        fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(row) + "\n").encode())
        finally:
            os.close(fd)
    return row


def read_events(path: str | Path) -> list[dict[str, Any]]:
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
