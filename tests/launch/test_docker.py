"""The Dockerfile (no engine here, so it is parsed): NGC PyTorch base, the package installed
with its declared extras, and no pip install of torch or megatron-core over the image's."""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def _args() -> dict[str, str]:
    return dict(rest.split("=", 1) for op, rest in _instructions() if op == "ARG" and "=" in rest)


def _pip_installs() -> list[list[str]]:
    """Argument lists of every `pip install` in RUN instructions (ARGs substituted)."""
    args = _args()
    cmds = []
    for op, rest in _instructions():
        if op != "RUN":
            continue
        rest = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), rest)
        lexer = shlex.shlex(rest, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words: list[str] = []
        for tok in [*lexer, ";"]:
            if tok and set(tok) <= set("&|;()<>"):  # an operator ends a simple command
                if "install" in words and words[words.index("install") - 1] == "pip":
                    cmds.append(words[words.index("install") + 1:])
                words = []
            else:
                words.append(tok)
    return cmds


def _extras() -> set[str]:
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "extras_require":
            return set(ast.literal_eval(node.value))
    raise AssertionError("setup.py declares no extras")


def test_base_is_ngc_pytorch_with_tag_argument() -> None:
    instr = _instructions()
    froms = [rest for op, rest in instr if op == "FROM"]
    assert froms == ["nvcr.io/nvidia/pytorch:${PYTORCH_TAG}"]
    assert re.fullmatch(r"\d\d\.\d\d-py3", _args()["PYTORCH_TAG"])
    assert instr.index(("FROM", froms[0])) > instr.index(("ARG", "PYTORCH_TAG=" +
                                                           _args()["PYTORCH_TAG"]))


def test_installs_the_package_with_declared_extras() -> None:
    targets = [w for cmd in _pip_installs() for w in cmd if w.startswith(".")]
    assert targets, "the package itself is never pip-installed"
    extras = {e for t in targets for m in re.findall(r"\[([\w,]+)\]", t) for e in m.split(",")}
    assert extras and extras <= _extras() & {"test", "dev", "resilience"}


def test_does_not_pip_install_torch_or_megatron_core() -> None:
    for cmd in _pip_installs():
        for word in cmd:
            if word.startswith("-"):
                continue
            name = re.split(r"[<>=!~\[ ;@]", word, maxsplit=1)[0].lower().replace("_", "-")
            assert name not in {"torch", "megatron-core", "torchvision", "torchaudio"}, cmd
        assert "--force-reinstall" not in cmd and "-U" not in cmd and "--upgrade" not in cmd


def test_dockerignore_keeps_venv_and_git_out() -> None:
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "runs"} <= set(ignored)


def test_image_check_runs_before_any_install() -> None:
    runs = [rest for op, rest in _instructions() if op == "RUN"]
    check = next(i for i, r in enumerate(runs) if "nemo_nutp/compat/tested.py" in r)
    first_install = next(i for i, r in enumerate(runs) if "pip install" in r)
    assert check < first_install


def test_setup_pins_exactly_the_tested_matrix() -> None:
    from nemo_nutp.compat.tested import TESTED

    tree = ast.parse((ROOT / "setup.py").read_text())
    reqs = next(ast.literal_eval(n.value) for n in ast.walk(tree)
                if isinstance(n, ast.keyword) and n.arg == "install_requires")
    pins = sorted(r for r in reqs if r.startswith("megatron-core"))
    assert pins == sorted([
        f"megatron-core=={TESTED[(3, 11)]['megatron-core']}; python_version < '3.12'",
        f"megatron-core=={TESTED[(3, 12)]['megatron-core']}; python_version >= '3.12'"])


def test_image_problem_messages() -> None:
    from nemo_nutp.compat.tested import image_problem

    assert image_problem((3, 12), None) is None
    assert image_problem((3, 12), "0.19.2") is None
    assert image_problem((3, 11), "0.16.1") is None
    msg = image_problem((3, 12), "0.15.0")
    assert msg is not None and "0.15.0" in msg and "0.19.2" in msg
    msg = image_problem((3, 10), None)
    assert msg is not None and "Python 3.10" in msg


def test_image_torch_that_ci_does_not_test_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from nemo_nutp.compat import tested

    monkeypatch.setattr(tested.metadata, "version",
                        lambda name: "2.6.0a0+ecf3bae40a" if name == "torch" else "0")
    note = tested.torch_note((3, 12))  # NGC 25.01's torch
    assert note is not None and "torch 2.6.0a0+ecf3bae40a" in note and "2.13.0" in note
    assert "tests/gpu/check.py run" in note
    monkeypatch.setattr(tested.metadata, "version", lambda name: "2.13.0+cpu")
    assert tested.torch_note((3, 12)) is None
