"""Metrics of a resumed run keep the steps before the resume point (rank-0 outputs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nemo_nutp.config import load_config
from nemo_nutp.train.loop import MetricsWriter


@pytest.mark.parametrize("previous", ["metrics.jsonl.partial", "metrics.jsonl"])
def test_resume_keeps_earlier_steps(tmp_path: Path, previous: str) -> None:
    cfg = load_config([f"output.dir={tmp_path}"])
    rows = [{"step": k, "loss": 5.0 - k} for k in range(6)]
    (tmp_path / previous).write_text("".join(json.dumps(r) + "\n" for r in rows))
    # Resume at step 4 (steps 4, 5 are recomputed) and at the end (nothing left to run).
    for start in (4, 6):
        out = MetricsWriter(cfg, None, start_step=start)  # type: ignore[arg-type]
        out.close()
        kept = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        assert kept == rows[:start]
        (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
