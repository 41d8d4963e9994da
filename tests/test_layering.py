"""The package's floors hold: every import, at module level or inside a function, points to the
importer's own floor or one below (``FLOORS``); folders on one floor import each other without a
cycle; the only upward imports are the named ``EXCEPTIONS``. Imports under ``TYPE_CHECKING`` are
types, not dependencies, and are not counted.

No two modules import each other in a cycle (module level, beyond the folders' graph), and no
entry point in ``launch/`` is named like a package folder.

And the control-process package (``recovery/``) and the light floors it stands on load neither
torch nor megatron-core when every one of their modules is imported (found by walking the
folders, not from a hand list): node agents and the control process start in ~1 s, not ~30 s.

The tests keep the same order: shared test code lives in ``tests/helpers``; no test module
imports another test module or any ``tests.<folder>`` module but ``tests.helpers``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "nemo_nutp"
TESTS = Path(__file__).resolve().parent

FLOORS: dict[str, int] = {
    "layout": 1,  # pure layout math
    "common": 2, "<root>": 2,  # console, ports, events, reports; the package root's filters
    "config": 3, "compat": 3, "data": 3, "model": 3, "parallel": 3,
    "sync": 4, "pipeline": 4, "checkpoint": 4, "goodput": 4, "relayout": 4, "health": 4,
    "live": 5, "train": 5, "integrations": 5,  # the rank-side runtime
    "recovery": 6,  # the light control processes
    "launch": 7,  # entry points
}
EXCEPTIONS = {
    # ``python -m nemo_nutp.train`` is the spelling launchers use for ``nutp-train``.
    ("nemo_nutp/train/__main__.py", "nemo_nutp.launch.nutp_train"),
}
LIGHT = ("recovery", "health", "common")
"""Folders whose every module imports without torch or megatron-core."""
LIGHT_MODULES = ("nemo_nutp.launch.control",)
"""And single modules: the Slurm control process's entry point."""


def _folder(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PKG / parts[1]).is_dir()) \
        else "<root>"


def _module(path: Path, root: Path = PKG) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                lines.update(range(sub.lineno, (sub.end_lineno or sub.lineno) + 1))
    return lines


def imports(path: Path, root: Path = PKG, top: str = "nemo_nutp") -> list[tuple[int, str]]:
    """(line, imported module) for every import of package ``top`` in ``path``, function bodies
    included, ``TYPE_CHECKING`` blocks left out; ``from . import x`` names ``x``'s module."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_lines(tree)
    me = _module(path, root)
    base = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
    out = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                root = ".".join(base[:len(base) - node.level + 1])
                mod = f"{root}.{node.module}" if node.module else root
            else:
                mod = node.module or ""
            if node.module is None:  # from . import a, b: each name is a module (or attribute)
                out += [(node.lineno, f"{mod}.{a.name}") for a in node.names]
            else:
                out.append((node.lineno, mod))
    return [(n, m) for n, m in out if m == top or m.startswith(f"{top}.")]


def violations(root: Path = PKG) -> tuple[list[str], dict[str, set[str]]]:
    """Upward imports (``file:line -> module``) and the same-floor folder graph."""
    bad, same = [], defaultdict(set)
    for path in sorted(root.rglob("*.py")):
        src = _folder(_module(path, root))
        if src not in FLOORS:
            bad.append(f"{path}: folder {src!r} has no floor in FLOORS")
            continue
        rel = str(path.relative_to(root.parent))
        for line, mod in imports(path, root):
            dst = _folder(mod) if mod != "nemo_nutp" else "<root>"
            if dst == src or (rel, mod) in EXCEPTIONS:
                continue
            if dst not in FLOORS:
                bad.append(f"{rel}:{line} -> {mod}: folder {dst!r} has no floor")
            elif FLOORS[dst] > FLOORS[src]:
                bad.append(f"{rel}:{line} -> {mod} (floor {FLOORS[src]} imports floor "
                           f"{FLOORS[dst]})")
            elif FLOORS[dst] == FLOORS[src]:
                same[src].add(dst)
    return bad, same


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(n: str, path: list[str]) -> list[str] | None:
        state[n] = 1
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return [*path, n, m]
            if m not in state and (c := visit(m, [*path, n])):
                return c
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (c := visit(n, [])):
            return c
    return None


def module_graph(root: Path = PKG) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (``from m import name`` counts as ``m``; a
    module's own parent packages and the package root are left out: not a cycle)."""
    paths = sorted(root.rglob("*.py"))
    mods = {_module(p, root) for p in paths}
    graph: dict[str, set[str]] = {}
    for path in paths:
        me = _module(path, root)
        deps = set()
        for _, mod in imports(path, root):
            while mod not in mods and "." in mod:
                mod = mod.rsplit(".", 1)[0]
            if mod in mods and mod not in (me, "nemo_nutp") and not me.startswith(mod + "."):
                deps.add(mod)
        graph[me] = deps
    return graph


def shared_test_code_violations(root: Path = TESTS) -> list[str]:
    """``file:line -> module`` for every import of a ``tests`` module that is not
    ``tests.helpers`` (relative imports resolved): a test module importing another one, or a
    module of another test folder."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        for line, mod in imports(path, root, top="tests"):
            if mod != "tests.helpers" and not mod.startswith("tests.helpers."):
                bad.append(f"{path.relative_to(root.parent)}:{line} -> {mod}")
    return bad


def test_every_import_points_down() -> None:
    bad, same = violations()
    assert not bad, "imports against the floors:\n" + "\n".join(bad)
    cycle = _cycle(same)
    assert cycle is None, f"same-floor folders import each other in a cycle: {cycle}"


def test_every_folder_has_a_floor() -> None:
    folders = {p.name for p in PKG.iterdir() if (p / "__init__.py").exists()}
    assert folders | {"<root>"} == set(FLOORS), sorted(folders ^ (set(FLOORS) - {"<root>"}))


def test_a_planted_upward_import_is_caught(tmp_path: Path) -> None:
    """The check itself can fail: a function-level import of the control package from the
    layout math, and a same-floor cycle, both in a copy of the tree."""
    import shutil

    copy = tmp_path / "nemo_nutp"
    shutil.copytree(PKG, copy, ignore=shutil.ignore_patterns("__pycache__"))
    with open(copy / "layout" / "plan.py", "a") as f:
        f.write("\n\ndef _planted() -> None:\n    from ..recovery import supervisor  # noqa\n")
    bad, _ = violations(copy)
    assert any("layout/plan.py" in b and "floor 1 imports floor 6" in b for b in bad), bad
    with open(copy / "sync" / "engine.py", "a") as f:
        f.write("\n\ndef _planted() -> None:\n    from ..goodput import cost  # noqa\n")
    with open(copy / "goodput" / "cost.py", "a") as f:
        f.write("\n\ndef _planted() -> None:\n    from ..sync import engine  # noqa\n")
    _, same = violations(copy)
    assert _cycle(same) is not None


def test_no_import_cycles_between_modules() -> None:
    cycle = _cycle(module_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_entry_points_are_not_named_like_folders() -> None:
    """``launch/`` holds the entry points; none shares its name with a package folder (before:
    the CLI module ``launch/train.py`` and the package ``train/``)."""
    folders = {p.name for p in PKG.iterdir() if (p / "__init__.py").exists()}
    assert not {p.stem for p in (PKG / "launch").glob("*.py")} & folders


def test_tests_share_code_only_through_helpers() -> None:
    bad = shared_test_code_violations()
    assert not bad, "tests importing test modules (move shared code to tests/helpers):\n" + \
        "\n".join(bad)
    assert (TESTS / "helpers" / "launch.py").exists()


def test_only_the_helper_starts_nutp_train() -> None:
    """``-m nemo_nutp.train`` (``nutp-train``) is spelled once in the tests, in
    ``tests/helpers/launch.py`` (``run_train``, ``start_train``): every test that starts it as a
    process does so through the helper (this file, which names it here, aside)."""
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        if path == Path(__file__).resolve():
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value == "nemo_nutp.train":
                found.append(str(path.relative_to(TESTS)))
    assert found == ["helpers/launch.py"], found


def test_a_planted_test_to_test_import_is_caught(tmp_path: Path) -> None:
    """The check itself can fail: an absolute import of another test module, a relative one,
    and an import of a non-helper module of another folder, in a copy of ``tests``."""
    import shutil

    copy = tmp_path / "tests"
    shutil.copytree(TESTS, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert shared_test_code_violations(copy) == []
    with open(copy / "live" / "test_live.py", "a") as f:
        f.write("\n\ndef _planted() -> None:\n"
                "    from tests.train.test_train import _metrics  # noqa\n")
    with open(copy / "train" / "test_parity_drawn.py", "a") as f:
        f.write("\nfrom .test_parity import SEVEN  # noqa\n")
    with open(copy / "sync" / "test_zero.py", "a") as f:
        f.write("\nimport tests.goodput  # noqa\n")
    bad = shared_test_code_violations(copy)
    assert any("live/test_live.py" in b and b.endswith("-> tests.train.test_train")
               for b in bad), bad
    assert any("train/test_parity_drawn.py" in b and b.endswith("-> tests.train.test_parity")
               for b in bad), bad
    assert any("sync/test_zero.py" in b and b.endswith("-> tests.goodput") for b in bad), bad
    assert len(bad) == 3, bad


@pytest.mark.timeout(600)
def test_light_packages_import_without_torch_or_megatron() -> None:
    mods = [*sorted(_module(p) for f in LIGHT for p in (PKG / f).rglob("*.py")), *LIGHT_MODULES]
    code = ("import sys\n" + "".join(f"import {m}\n" for m in mods)
            + "print(sorted(m for m in ('torch', 'megatron.core') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=300).stdout.strip()
    assert out == "[]", f"heavy modules imported by {LIGHT}: {out}"
    assert len(mods) >= 12, mods
