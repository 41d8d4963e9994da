"""CI runs the Bridge tests by name (the Makefile's ``TESTS_BRIDGE``, under Python 3.12): a test
file that skips itself without Bridge and is not on that list never runs anywhere (three did,
until this check)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _listed(name: str) -> set[str]:
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    m = re.search(rf"^{name} \?=(.*)$", text, re.M)
    assert m, name
    return {w.split("::")[0] for w in m.group(1).split()}


def test_every_bridge_only_test_file_is_in_the_bridge_leg() -> None:
    listed = _listed("TESTS_BRIDGE")
    skipped = [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "tests").rglob("test_*.py"))
               if re.search(r"pytest\.skip\([^)]*(Bridge|bridge)", p.read_text())]
    assert skipped, "no Bridge-only test file found: the pattern is stale"
    missing = [f for f in skipped if f not in listed]
    assert not missing, f"not in the Makefile's TESTS_BRIDGE (never run by CI): {missing}"
