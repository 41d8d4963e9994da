"""docs/config.md is generated from the schema's field docstrings and kept current (issue #37)."""

from __future__ import annotations

from pathlib import Path

from nemo_nutp.config import docs, schema_keys

ROOT = Path(__file__).resolve().parents[2]


def test_config_md_is_current() -> None:
    page = (ROOT / "docs" / "config.md").read_text()
    assert page == docs.render(), (
        f"docs/config.md is stale: run `make config-docs` ({docs.COMMAND})")


def test_every_schema_key_is_documented() -> None:
    page = docs.render()
    missing = [k for k in schema_keys() if f"- `{k}` (" not in page]
    assert not missing, f"keys without an entry in docs/config.md: {missing}"
    assert "(no docstring)" not in page, "a config field without a docstring"
