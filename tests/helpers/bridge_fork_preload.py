"""Imported once by ``bridge_fork``'s fork server (only there): what a Bridge rank of the tests
does first (the CPU patches of ``dist.gloo_rank``, the Hugging Face hub offline of
``hf_offline``), then Bridge, its training loop, the Qwen3-MoE recipe and the NUTP modules a
Bridge rank runs (``integrations/bridge_preload.py``, as ``nutp-bridge``'s own fork server)."""

from __future__ import annotations

from nemo_nutp.compat.cpu import apply_cpu_patches

from .hf_offline import offline_hf

apply_cpu_patches()
offline_hf()

import megatron.bridge.recipes.qwen.qwen3_moe  # noqa: E402,F401

import nemo_nutp.integrations.bridge_config  # noqa: E402
import nemo_nutp.integrations.bridge_preload  # noqa: E402,F401

from . import bridge_moe_jobs, bridge_stock  # noqa: E402,F401
