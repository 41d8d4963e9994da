"""The Megatron-Bridge commands of README.md and docs/*.md (``.venv312/bin/...``; the Python 3.11
README test skips them by that name) run as written here, in a scratch directory; the YAML example
of docs/bridge.md is the override file the commands and the Bridge tests use. A ``nutp-bridge``
command leaves ``nutp-train``'s outputs in its ``output.dir`` and prints the goodput report."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("megatron.bridge") is None:
    pytest.skip("megatron-bridge is not installed (make test-bridge installs it)",
                allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
PY312 = ".venv312/bin/"


def _section() -> str:
    """The Bridge page (docs/bridge.md), which holds the YAML example."""
    return (ROOT / "docs" / "bridge.md").read_text()


def _pages() -> list[Path]:
    """README.md, then every docs/*.md by name."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def bridge_commands() -> list[str]:
    out = []
    blocks = [b for page in _pages()
              for b in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S)]
    for block in blocks:
        text = re.sub(r"\\\n\s*", " ", block)
        out += [line.strip() for line in text.splitlines() if line.strip().startswith(PY312)]
    return out


def test_readme_yaml_example_is_the_tested_override_file() -> None:
    from omegaconf import OmegaConf

    blocks = re.findall(r"```yaml\n(.*?)```", _section(), re.S)
    assert blocks, "docs/bridge.md: no YAML example"
    shown = OmegaConf.to_container(OmegaConf.create(blocks[0]))
    tiny = ROOT / "tests" / "integrations" / "data" / "bridge_tiny.yaml"
    tested = OmegaConf.to_container(OmegaConf.load(tiny))
    assert shown == tested


@pytest.mark.timeout(1500)
def test_readme_bridge_commands_run(tmp_path: Path) -> None:
    cmds = bridge_commands()
    assert cmds, "README.md and docs/*.md: no .venv312 command"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for cmd in cmds:
        argv = shlex.split(cmd, comments=True)
        argv[0] = str(Path(sys.executable).parent / Path(argv[0]).name)
        argv = [str(ROOT / a) if (ROOT / a).exists() and not a.startswith("/") else a
                for a in argv]
        r = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=1200,
                           check=False, env=env)
        out = r.stdout + r.stderr
        assert r.returncode == 0, f"README: {cmd}\n{out[-4000:]}"
        # Bridge logs (INFO) the traceback of each optional import it tries and skips
        # (``utils/import_utils.py`` safe_import_from: "Import of X from Y failed with: ...").
        real = out.replace("failed with: Traceback", "failed with:")
        assert "Traceback" not in real, f"README: {cmd}\n{out[-4000:]}"
        if argv[1:2] == ["sbatch"]:  # the batch script (docs/cluster.md), valid bash
            script = tmp_path / argv[argv.index("--out") + 1]
            assert subprocess.run(["bash", "-n", str(script)]).returncode == 0, cmd
            assert "nutp-bridge" in script.read_text(), cmd
        elif Path(argv[0]).name == "nutp-bridge":  # nutp-train's outputs, in output.dir
            d = tmp_path / next((v.split("=", 1)[1] for v in argv if v.startswith(
                "output.dir=")), argv[argv.index("--output-dir") + 1]
                if "--output-dir" in argv else "runs/bridge")
            for name in ("metrics.jsonl", "goodput.json", "training.png"):
                assert (d / name).is_file(), f"README: {cmd}: no {d / name}"
            assert "Goodput report" in out, f"README: {cmd}\n{out[-4000:]}"
