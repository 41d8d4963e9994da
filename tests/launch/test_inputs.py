"""Issue #16 (start of its battery): bad input is one line naming the file or key, outputs are
group-readable. Each case failed on the code before (traceback, silent range, mode 0600)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from nemo_nutp.layout import HealthReport
from nemo_nutp.layout.serialize import atomic_path, write_json_atomic
from tests.helpers.launch import run_train


@pytest.mark.parametrize("text", ["5-2", "9-3"])
def test_reversed_range_is_an_error(text: str) -> None:
    with pytest.raises(ValueError, match=r"health\.failed_gpus=.*reversed range"):
        HealthReport.from_cli(text)


@pytest.mark.parametrize("text", ["a", "-3", "4-", "1-x", "1-2-3"])
def test_malformed_ids_are_errors(text: str) -> None:
    with pytest.raises(ValueError, match=r"health\.failed_gpus"):
        HealthReport.from_cli(text)


@pytest.mark.parametrize(("name", "body", "what"), [
    ("bad.yaml", "failed_gpus: [1, 2\n", "malformed YAML"),
    ("bad.json", '{"failed_gpus": [1,', "malformed JSON"),
])
def test_malformed_health_report_names_the_file(tmp_path: Path, name: str, body: str,
                                                what: str) -> None:
    path = tmp_path / name
    path.write_text(body)
    with pytest.raises(ValueError, match=what) as e:
        HealthReport.from_file(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_nutp_train_malformed_report_is_one_line_exit_2(tmp_path: Path) -> None:
    report = tmp_path / "health.yaml"
    report.write_text("failed_gpus: [1, 2\n")
    out = tmp_path / "never"
    r = run_train([f"output.dir={out}", "health=report", f"health.report={report}"],
                  timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if "error:" in ln]
    assert len(lines) == 1 and str(report) in lines[0], r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    assert not out.exists()


def test_outputs_are_group_readable(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        write_json_atomic({"a": 1}, tmp_path / "x.json")
        with atomic_path(tmp_path / "y.png", suffix=".png") as tmp:
            tmp.write_bytes(b"png")
        with atomic_path(tmp_path / "z.sh", mode=0o755) as tmp:
            tmp.write_text("#!/bin/sh\n")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "x.json").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "y.png").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "z.sh").stat().st_mode) == 0o755
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.json", "y.png", "z.sh"]


def test_failed_write_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), atomic_path(tmp_path / "x.json") as tmp:
        tmp.write_text("half")
        raise RuntimeError("crash while writing")
    assert list(tmp_path.iterdir()) == []


def test_unknown_key_names_the_closest_schema_keys() -> None:
    from nemo_nutp.config import load_config

    with pytest.raises(ValueError) as e:
        load_config(["train.stepz=3"])
    msg = str(e.value)
    assert msg.startswith("train.stepz: unknown key") and "train.steps" in msg, msg
    assert "+train" not in msg and "\n" not in msg  # Hydra's hint would fail in the schema
