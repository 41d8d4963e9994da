"""Issue #16: every command in the bash blocks of README.md and docs/*.md runs as written, with
fewer steps.

Commands are read from the pages themselves (``doc_pages()``: README first, then the docs pages in
``PAGES`` order, then any other page), so a new example is tested the day it is added.
Cluster-only programs (``torchrun``, ``ft_launcher``, ``srun``, ``sbatch``, ``docker``,
``enroot``) are not run; ``make`` targets and benchmark scripts are long (they are what CI and
``make bench``/``make sim`` run): their targets/scripts must exist. Everything else runs in a
scratch directory (relative paths as a user's), one block after another in order (a resume
example finds the checkpoints of the example before it, on the same page), ``nutp-train`` with
few steps, ``nutp simulate`` with few trials (the number of draws changes no code path),
placeholders (``<partition>``, ``/path/to/prefix``, a trailing ``...``) filled in.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
CLUSTER_ONLY = {"torchrun", "ft_launcher", "srun", "sbatch", "docker", "enroot"}
LONG = {"make", "python"}
PY312 = ".venv312/bin/"
"""Commands of the Python 3.12 environment (``nutp-bridge``): not run here (no Bridge in this
environment), run by ``tests/integrations/test_bridge_readme.py`` (``make test-bridge``)."""


PAGES = ["training", "exactness", "pipeline", "stragglers", "planning", "simulator", "cluster",
         "bridge", "checkpoints", "recovery", "live"]
"""docs/ pages in the order their commands run (the README's order before the manual was split:
the checkpoint examples before the recovery and live ones that resume from them); pages not listed
run after these, sorted by name."""


def doc_pages() -> list[Path]:
    """README.md, then docs/*.md: ``PAGES`` first, in that order, then the rest by name."""
    listed = [ROOT / "docs" / f"{name}.md" for name in PAGES]
    missing = [p.name for p in listed if not p.is_file()]
    assert not missing, f"PAGES names missing docs pages: {missing}"
    rest = sorted(p for p in (ROOT / "docs").glob("*.md") if p not in listed)
    return [ROOT / "README.md", *listed, *rest]


def readme_commands() -> list[list[str]]:
    """Per bash block of README.md and docs/*.md (``doc_pages()`` order), its commands
    (continuations joined, comments dropped)."""
    blocks = [b for page in doc_pages()
              for b in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S)]
    out = []
    for block in blocks:
        text = re.sub(r"\\\n\s*", " ", block)
        cmds = [shlex.split(line, comments=True) for line in text.splitlines()]
        out.append([" ".join(map(shlex.quote, c)) for c in cmds if c])
    return out


def _steps(argv: list[str], steps: int) -> list[str]:
    """``nutp-train`` with ``train.steps`` lowered to ``steps`` (enough to reach an injected
    fault's step)."""
    fault = [int(a.split("=")[1]) for a in argv if a.startswith("recovery.fault.step=")]
    n = max([steps] + [f + 2 for f in fault])
    return [a for a in argv if not a.startswith("train.steps=")] + [f"train.steps={n}"]


def _trials(argv: list[str], trials: int = 8) -> list[str]:
    """``nutp simulate`` with ``sim.trials`` lowered to ``trials`` (the scenario's own count
    otherwise: 200 for paper_32k)."""
    rest = [a for a in argv[2:] if not a.startswith("sim.trials=")]
    return [*argv[:2], f"sim.trials={trials}", *rest]  # overrides come before the flags


def _dataset(prefix: Path) -> None:
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix.parent.mkdir(parents=True, exist_ok=True)
    b = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    rng = np.random.default_rng(0)
    for _ in range(16):
        b.add_document(torch.from_numpy(rng.integers(0, 100, 80).astype(np.int32)), [80])
    b.finalize(f"{prefix}.idx")


def _prepare(cmd: str, scratch: Path, env: dict[str, str]) -> list[str] | None:
    """argv to run for a README command (its ``VAR=value`` prefixes go to ``env``), or None
    (cluster-only or long: checked, not run)."""
    data = scratch / "data" / "prefix"
    cmd = (cmd.replace("/path/to/prefix", str(data)).replace("/data/<prefix>", str(data))
           .replace("/results/", str(scratch / "results") + "/"))
    argv = [re.sub(r"^<(\w+)>$", r"\1", a) for a in shlex.split(cmd) if a != "..."]
    while re.match(r"^[A-Z_]+=", argv[0]):  # VAR=value prefixes: the command's environment
        key, value = argv.pop(0).split("=", 1)
        env[key] = value
    prog = Path(argv[0]).name
    if argv[0].startswith(PY312):  # Megatron-Bridge: Python 3.12 only, run by name there
        return None
    if prog in CLUSTER_ONLY:
        return None
    if prog == "make":
        r = subprocess.run(["make", "-n", *argv[1:]], cwd=ROOT, capture_output=True, text=True,
                           check=False)
        assert r.returncode == 0, f"{cmd}: {r.stderr}"
        return None
    if prog in LONG:
        assert (ROOT / argv[1]).is_file(), cmd
        return None
    assert argv[0].startswith(".venv/bin/"), f"{cmd}: run it from .venv/bin or mark it"
    return [str(BIN / prog), *argv[1:]]


@pytest.mark.dist
@pytest.mark.timeout(1800)
def test_readme_commands_run(tmp_path: Path) -> None:
    _dataset(tmp_path / "data" / "prefix")
    ran, steps = [], 2
    for block in readme_commands():
        for cmd in block:
            env = dict(os.environ)
            argv = _prepare(cmd, tmp_path, env)
            if argv is None:
                continue
            if Path(argv[0]).name == "nutp-train":
                argv, steps = _steps(argv, steps), steps + 2  # a resume example trains on
            if argv[1:2] == ["simulate"]:
                argv = _trials(argv)
            r = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True,
                               timeout=900, check=False, env=env)
            assert r.returncode == 0, f"README: {cmd}\n{r.stdout[-3000:]}{r.stderr[-3000:]}"
            assert "Traceback" not in r.stdout + r.stderr, cmd
            ran.append(cmd)
    assert sum("nutp-train" in c for c in ran) >= 5 and sum("nutp plan" in c for c in ran) >= 3
