"""Run the recovery and elastic tests N times in a row beside a CPU hog (issue #16's acceptance).

    .venv/bin/python tests/helpers/soak.py [--runs 5] [--hogs CORES+2] [pytest args...]

The hog is ``--hogs`` busy processes (default: cores + 2, more than the machine has). Prints one
line per run and a summary; exit code 0 only if every run passed. Not collected by pytest (no
``test_`` prefix): it is a soak, not a unit test.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

TESTS = ["tests/recovery/test_supervisor.py", "tests/train/test_elastic.py",
         "tests/health/test_hang_blame.py"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--hogs", type=int, default=(os.cpu_count() or 2) + 2)
    args, rest = ap.parse_known_args()
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(args.hogs)]
    results = []
    try:
        for i in range(args.runs):
            t0 = time.time()
            r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", *TESTS, *rest],
                               capture_output=True, text=True, check=False)
            tail = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-200:]
            results.append(r.returncode == 0)
            print(f"run {i + 1}/{args.runs}: {'PASS' if r.returncode == 0 else 'FAIL'} "
                  f"({time.time() - t0:.0f} s, {args.hogs} hogs): {tail}", flush=True)
            if r.returncode != 0:
                print(r.stdout[-6000:], flush=True)
    finally:
        for h in hogs:
            h.kill()
    print(f"{sum(results)}/{len(results)} runs passed beside {args.hogs} busy processes")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
