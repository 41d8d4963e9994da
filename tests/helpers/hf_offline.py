"""Hugging Face configs without the network: the committed stand-ins under ``configs/hf/hub``
(a hub cache layout; see its README), for Bridge recipes that read an HF config
(``AutoBridge.from_hf_pretrained``). Used by ``benchmarks/recipe_coverage.py`` and its test."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
HF_HUB = ROOT / "configs" / "hf" / "hub"


def offline_hf() -> None:
    """The Hugging Face hub is never reached: ``HF_HUB_OFFLINE`` with the committed cache
    (``configs/hf/hub``), and Bridge's config loader (which retries a missing config for 7 s)
    reads a committed snapshot directly, or fails at once naming the repository."""
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_CACHE=str(HF_HUB))
    from nemo_nutp.compat.bridge_cpu import install_import_shim

    install_import_shim()
    from megatron.bridge.models.conversion import auto_bridge

    if getattr(auto_bridge.safe_load_config_with_retry, "_nutp_offline", False):
        return
    real = auto_bridge.safe_load_config_with_retry

    def load(path: Any, trust_remote_code: bool = False, **kwargs: Any) -> Any:
        local = standin(str(path))
        if local is None and not Path(str(path)).is_dir():
            raise FileNotFoundError(f"hf_config={path}: no committed stand-in of its "
                                    f"config.json under {HF_HUB.relative_to(ROOT)}")
        return real(local or path, trust_remote_code=trust_remote_code, max_retries=0,
                    **kwargs)

    load._nutp_offline = True  # type: ignore[attr-defined]
    auto_bridge.safe_load_config_with_retry = load


def standin(repo: str) -> str | None:
    """The committed snapshot folder of ``repo``'s config.json, or None."""
    base = HF_HUB / ("models--" + repo.replace("/", "--"))
    ref = base / "refs" / "main"
    if not ref.is_file():
        return None
    return str(base / "snapshots" / ref.read_text().strip())
