"""Issue #16: the package layout says what each module is, with no import circles, and the
README's links stay inside the repository. (Before: ``launch/`` held the recovery code,
``launch/supervisor.py`` and ``launch/train.py`` imported each other, and the CLI module
``launch/train.py`` shared its name with the package ``train/``; the design link pointed
outside the repository.)"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "nemo_nutp"


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """nemo_nutp modules ``path`` imports, anywhere in it (lazy imports included)."""
    mod = _module(path)
    pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
            out.update(n for n in names if n.startswith("nemo_nutp"))
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("nemo_nutp"))
    modules = {_module(p) for p in PKG.rglob("*.py")}
    return {m for m in out if m in modules} - {mod}


def test_no_import_cycles_between_modules() -> None:
    graph = {_module(p): _imports(p) for p in PKG.rglob("*.py")}
    graph = {m: {d for d in deps if not m.startswith(d + ".") and d != "nemo_nutp"}
             for m, deps in graph.items()}  # a package's own __init__ is not a cycle
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*stack[stack.index(d):], d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_recovery_is_its_own_package_and_cli_names_are_distinct() -> None:
    assert {p.stem for p in (PKG / "recovery").glob("*.py")} >= {
        "decisions", "watch", "supervisor", "elastic"}
    launch = {p.stem for p in (PKG / "launch").glob("*.py")}
    assert not launch & {"supervisor", "elastic", "watch", "recovery"}
    assert not launch & {p.name for p in PKG.iterdir() if p.is_dir()}  # no launch/train.py
    for p in (PKG / "launch").glob("*.py"):
        assert not any(m.startswith("nemo_nutp.recovery") for m in _imports(p)
                       if p.stem != "nutp_train"), p  # only the entry point starts recovery


def test_readme_links_stay_inside_the_repository() -> None:
    """README.md's and docs/*.md's relative links resolve to files of the repository."""
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)#]+)\)", text):
            if "://" in target:
                continue
            path = (page.parent / target).resolve()
            assert path.is_relative_to(ROOT) and path.exists(), f"{page.name}: {target}"
        assert "../shared" not in text, page.name
