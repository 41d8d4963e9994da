"""``make gpu-check-prepare`` / ``make gpu-check``: the GPU checks on a borrowed machine.

The machine we can expect to borrow (one H200, sometimes 2-8 GPUs) has Python 3.12 with its own
torch (2.11, CUDA 13), numpy, pytest, pytest-timeout, rich, pyyaml, psutil, but no megatron-core,
Hydra or OmegaConf, no network, and at most 64 MiB of files brought in.

* ``prepare`` (a CPU machine with ``.venv312``): wheels of exactly the megatron-core, hydra-core,
  omegaconf and antlr4 runtime versions ``.venv312`` holds (the tested ones), and the project's
  own wheel, into ``.gpu-check/wheels`` (git-ignored); fails if they reach 64 MiB.
* ``run`` (the GPU machine): without CUDA prints why and exits 0; else installs the wheels
  beside the machine's torch (``pip --no-index --no-deps --target``; without wheels, where
  megatron-core and Hydra are installed, e.g. in this project's Docker image, it tests those
  and the image's torch), runs the ``gpu``-marked
  tests (limit 8 minutes) and writes ``<out>/gpu_check.json`` (per test: outcome, seconds,
  measured numbers) and ``<out>/gpu_check.log``; ``<out>`` is ``$GPU_CHECK_OUT`` or
  ``runs/gpu_check``. Never needed by CI.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WHEELS = ROOT / ".gpu-check" / "wheels"
LIMIT_BYTES = 64 * 2 ** 20
PACKAGES = ("megatron-core", "hydra-core", "omegaconf", "antlr4-python3-runtime")
TESTS = ("tests/gpu/test_gpu.py", "tests/gpu/test_nccl.py", "tests/model/test_specs.py")
TIME_LIMIT_S = 480


def _versions(python: Path) -> list[str]:
    code = ("import importlib.metadata as m; print(' '.join(f'{p}=={m.version(p)}' for p in "
            f"{list(PACKAGES)!r}))")
    return subprocess.run([str(python), "-c", code], check=True, capture_output=True,
                          text=True).stdout.split()


def prepare(python: Path) -> int:
    """Gather the wheels with ``python`` (Python 3.12, x86-64: the GPU machine's tags)."""
    import shutil

    shutil.rmtree(WHEELS, ignore_errors=True)
    WHEELS.mkdir(parents=True)
    pins = _versions(python)
    print("gpu-check-prepare:", " ".join(pins), "+ nemo_nutp", flush=True)
    pip = [str(python), "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(WHEELS)]
    subprocess.run([*pip, *pins], check=True)  # antlr4 4.9.3 is an sdist: built (pure Python)
    subprocess.run([*pip, "--no-build-isolation", str(ROOT)], check=True)
    files = sorted(WHEELS.glob("*.whl"))
    total = sum(f.stat().st_size for f in files)
    for f in files:
        print(f"  {f.stat().st_size / 2 ** 20:7.2f} MiB  {f.name}")
    print(f"  {total / 2 ** 20:7.2f} MiB  total in {WHEELS.relative_to(ROOT)} "
          f"(limit {LIMIT_BYTES // 2 ** 20} MiB)")
    if total >= LIMIT_BYTES:
        print("gpu-check-prepare: over the limit", file=sys.stderr)
        return 1
    return 0


def _junit_results(path: Path) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = "passed"
        message = ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (node.get("message") or "")[:500]
        props = {p.get("name"): _num(p.get("value")) for p in case.iter("property")}
        out.append({"test": f"{case.get('classname')}::{case.get('name')}",
                    "outcome": outcome, "seconds": float(case.get("time") or 0.0),
                    "message": message, "measured": props})
    return out


def _num(v: str | None) -> object:
    try:
        return float(v) if v is not None else None
    except ValueError:
        return v


def run(out: Path) -> int:
    """Install the wheels, run the gpu tests, write one JSON + log under ``out``."""
    try:
        import torch
    except ImportError:
        print(f"gpu-check: skipped: {sys.executable} has no torch (the GPU machine's python3 "
              "holds its own)")
        return 0
    if not torch.cuda.is_available():
        print("gpu-check: skipped: no CUDA device here (torch.cuda.is_available() is False); "
              "run it on a GPU machine after `make gpu-check-prepare`")
        return 0
    import importlib.util

    wheels = sorted(WHEELS.glob("*.whl"))
    have = all(importlib.util.find_spec(m) for m in ("megatron.core", "hydra", "omegaconf"))
    if not wheels and not have:
        print(f"gpu-check: no wheels in {WHEELS} and no megatron-core/hydra here: run `make "
              "gpu-check-prepare` on a machine with network first", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    path = str(ROOT)
    if wheels:  # else: the image's own packages (the NGC image: its torch is what is tested)
        site = Path(os.environ.get("GPU_CHECK_SITE", "/tmp/nutp-gpu-site"))
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                        "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(site),
                        *map(str, wheels)], check=True)
        path += os.pathsep + str(site)
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
    xml, log = out / "junit.xml", out / "gpu_check.log"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-rs", "-p", "no:cacheprovider",
           f"--junitxml={xml}", "-o", "junit_family=xunit1", *TESTS]
    with log.open("w") as f:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                timeout=TIME_LIMIT_S, check=False).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    results = _junit_results(xml) if xml.exists() else []
    summary = {"returncode": rc, "gpus": torch.cuda.device_count(),
               "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
               "tests": results}
    tmp = out / "gpu_check.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2))
    tmp.replace(out / "gpu_check.json")
    xml.unlink(missing_ok=True)
    for r in results:
        print(f"{r['outcome']:>8}  {r['seconds']:6.1f} s  {r['test']}  {r['measured'] or ''}")
    print(f"gpu-check: rc={rc}; results {out / 'gpu_check.json'}, log {log}")
    return int(rc)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--python", type=Path, default=ROOT / ".venv312" / "bin" / "python")
    sub.add_parser("run")
    args = ap.parse_args(argv)
    if args.cmd == "prepare":
        return prepare(args.python)
    return run(Path(os.environ.get("GPU_CHECK_OUT", ROOT / "runs" / "gpu_check")))


if __name__ == "__main__":
    sys.exit(main())
