"""A checkpoint's model fields, as its JSON marker holds them, compare equal to the job's, tuple
fields included (``model.window_size``), and a different value is one line naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nemo_nutp.checkpoint.store import FORMAT, _dims, check_compatible
from nemo_nutp.config import ModelConfig


def test_tuple_fields_survive_the_marker_and_differences_are_named(tmp_path: Path) -> None:
    saved = ModelConfig(window_size=(3, 0), window_attn_skip_freq=2)
    marker = json.loads(json.dumps({"format": FORMAT, "model": _dims(saved)}))
    check_compatible(marker, ModelConfig(window_size=(3, 0), window_attn_skip_freq=2), tmp_path)
    with pytest.raises(ValueError, match=r"^model\.window_size=\[5, 0\]: checkpoint .* saved "
                                         r"with model\.window_size=\[3, 0\]$"):
        check_compatible(marker, ModelConfig(window_size=(5, 0), window_attn_skip_freq=2),
                         tmp_path)
