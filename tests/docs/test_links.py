"""README.md's and docs/*.md's relative links resolve to files of the repository (issue #16: the
design link pointed outside it)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_readme_links_stay_inside_the_repository() -> None:
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)#]+)\)", text):
            if "://" in target:
                continue
            path = (page.parent / target).resolve()
            assert path.is_relative_to(ROOT) and path.exists(), f"{page.name}: {target}"
        assert "../shared" not in text, page.name
