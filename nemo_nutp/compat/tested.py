"""The tested matrix (Python -> torch, megatron-core) and the container-image check.

Standard library only: the Dockerfile runs this file *before* installing nemo_nutp, to fail the
build with a clear message when the base image's Python or megatron-core is not one CI tests
(``python nemo_nutp/compat/tested.py``). ``setup.py`` pins megatron-core per Python version to
the same table (a test checks they agree).
"""

from __future__ import annotations

import sys
from importlib import metadata

TESTED: dict[tuple[int, int], dict[str, str]] = {
    (3, 11): {"torch": "2.13.0", "megatron-core": "0.16.1"},
    (3, 12): {"torch": "2.13.0", "megatron-core": "0.19.2"},
}
"""Python (major, minor) -> versions CI runs the suite with (``make test``)."""


def image_problem(python: tuple[int, int], installed: str | None) -> str | None:
    """Why an image with this Python and megatron-core (None: not installed) is not tested."""
    tested = ", ".join(f"Python {a}.{b} with megatron-core {v['megatron-core']}"
                       for (a, b), v in TESTED.items())
    want = TESTED.get(python)
    if want is None:
        return f"Python {python[0]}.{python[1]} is not tested (tested: {tested})"
    if installed is not None and installed != want["megatron-core"]:
        return (f"the image ships megatron-core {installed}; nemo_nutp is tested with "
                f"megatron-core {want['megatron-core']} on Python {python[0]}.{python[1]} "
                f"(tested: {tested}). Use a base image without megatron-core (the tested one "
                "is then installed) or one that ships the tested version.")
    return None


def main() -> int:
    try:
        installed: str | None = metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        installed = None
    problem = image_problem(sys.version_info[:2], installed)
    if problem:
        print(f"nemo_nutp: {problem}", file=sys.stderr)
        return 1
    print(f"nemo_nutp: Python {sys.version.split()[0]}, megatron-core "
          f"{installed or 'not installed (will be installed)'}: tested")
    note = torch_note(sys.version_info[:2])
    if note:
        print(f"nemo_nutp: {note}")
    return 0


def torch_note(python: tuple[int, int]) -> str | None:
    """A container keeps its own CUDA torch (never replaced); say when CI does not test it."""
    try:
        have = metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None
    want = TESTED.get(python, {}).get("torch")
    if want is None or have.split("+")[0] == want:
        return None
    return (f"torch {have} is kept (the image's CUDA build) but CI tests torch {want} on CPU; "
            "on a GPU node run `python tests/gpu/check.py run` in this image (the gpu-marked "
            "tests against this torch)")


if __name__ == "__main__":
    sys.exit(main())
