"""Imported once by the recovery supervisor's fork server under ``nutp-bridge
recovery.enabled=true`` (``launch/bridge_cli.py`` ``BRIDGE_PRELOAD``): Bridge's import shim, then
Bridge's training loop and the NUTP modules a Bridge rank runs, so a started or restarted rank
forks with them loaded instead of importing them itself."""

from __future__ import annotations

from ..compat.bridge_cpu import install_import_shim

install_import_shim()

import megatron.bridge.training.train  # noqa: E402,F401

from . import bridge_ckpt, bridge_data, bridge_recovery, bridge_run  # noqa: E402,F401
